//! Quiet hours end to end (docs/rules.md#quiet-hours): what a quiet channel would send during
//! its window is held in Redis and released once when the window ends, whatever is killed or
//! reloaded meanwhile.
//!
//! No test waits for a real night: keywatch runs with its quiet hours reading the wall clock
//! ahead (`KEYWATCH_DRILL_QUIET_AHEAD`, docs/development.md), so that it is near the end of a
//! minute, and a window of that one minute ends seconds after keywatch starts.

use std::time::Duration;

use chrono::{DateTime, Timelike, Utc};
use serde_json::Value;

use crate::common;

use common::{Daemon, HttpReceiver, Logs, PATIENCE, RedisServer, run_subscribed, wait_until};

/// How long before the end of its minute quiet hours' clock reads when a drill starts: time for
/// keywatch to start and the keys to expire, while the window is still open.
const BEFORE_THE_END: i64 = 20;

/// Longest a release may take after its window ended (docs/rules.md: within 5 s), and the
/// drill's own slack on a loaded machine.
const RELEASED_WITHIN: Duration = Duration::from_secs(BEFORE_THE_END as u64 + 20);

/// A quiet hours' clock [`BEFORE_THE_END`] seconds before the end of a minute: the
/// `KEYWATCH_DRILL_QUIET_AHEAD` that makes it so (by Redis's clock, which keywatch reads), and
/// that minute (and `minutes - 1` more) as a window `night`, every day, in UTC.
fn closing_window(redis: &RedisServer, minutes: i64) -> (String, String) {
    let now = redis_now(redis);
    let ahead = (60 - BEFORE_THE_END - i64::from(now.second())).rem_euclid(60);
    let at = now + chrono::Duration::seconds(ahead);
    let from = at.format("%H:%M").to_string();
    let end = at + chrono::Duration::minutes(minutes);
    let to = if end.date_naive() != at.date_naive() {
        "24:00".to_string()
    } else {
        end.format("%H:%M").to_string()
    };
    let window = format!(
        "quiet_hours:\n  night:\n    - {{ days: [mon, tue, wed, thu, fri, sat, sun], from: \"{from}\", to: \"{to}\" }}\n"
    );
    (format!("{ahead}s"), window)
}

/// keywatch on `redis` with `yaml`, its quiet hours reading the clock `ahead`.
fn launch(redis: RedisServer, yaml: &str, ahead: &str) -> Daemon {
    Daemon::launch(
        redis,
        common::Rules::new(yaml),
        Logs::Json,
        &[("KEYWATCH_DRILL_QUIET_AHEAD", ahead)],
    )
}

/// Redis's clock.
fn redis_now(redis: &RedisServer) -> DateTime<Utc> {
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut redis.conn()).unwrap();
    DateTime::from_timestamp(secs, (micros * 1000) as u32).unwrap()
}

/// `keywatch history --json` of `daemon`'s Redis.
fn history(daemon: &Daemon) -> Vec<Value> {
    common::history_json(&daemon.redis.url(), &daemon.rules.path, &[])
}

/// The outcomes history shows for `key`'s actions.
fn outcomes(daemon: &Daemon, key: &str) -> Vec<String> {
    history(daemon)
        .iter()
        .filter(|r| r["key"] == key)
        .flat_map(|r| r["actions"].as_array().cloned().unwrap_or_default())
        .map(|a| a["outcome"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// How many messages quiet hours hold now (their index and hashes in Redis).
fn held_in_redis(redis: &RedisServer) -> usize {
    let mut c = redis.conn();
    let groups: Vec<String> = redis::cmd("ZRANGE")
        .arg("keywatch:held")
        .arg(0)
        .arg(-1)
        .query(&mut c)
        .unwrap();
    groups
        .iter()
        .map(|g| {
            let (channel, end): (String, i64) = serde_json::from_str(g).unwrap();
            redis::cmd("HLEN")
                .arg(format!("keywatch:held:{channel}:{end}"))
                .query::<usize>(&mut c)
                .unwrap()
        })
        .sum()
}

/// A rule `lock` on `lock:*` notifying `channels` (all Slack channels on `hook`, each quiet with
/// its `release`), and a rule `urgent` on `urgent:*` that says `notify.quiet: ignore`.
fn rules(window: &str, hook: &HttpReceiver, channels: &[(&str, &str)]) -> String {
    let mut yaml = format!("{window}channels:\n");
    for (name, release) in channels {
        yaml.push_str(&format!(
            "  {name}: {{ type: slack, url: \"{}\", quiet: {{ during: night, release: {release} }} }}\n",
            hook.url_for(&format!("/{name}"))
        ));
    }
    let to: Vec<&str> = channels.iter().map(|(n, _)| *n).collect();
    yaml.push_str(&format!(
        "rules:\n  - name: lock\n    match: \"lock:{{id}}\"\n    notify: {{ to: [{to}], message: \"Lock {{{{ id }}}} expired.\" }}\n  - name: urgent\n    match: \"urgent:{{id}}\"\n    notify: {{ to: [{to}], message: \"Urgent {{{{ id }}}} expired.\", quiet: ignore }}\n",
        to = to.join(", ")
    ));
    yaml
}

/// Waits until history shows every action of `keys` held.
fn wait_until_held(daemon: &Daemon, keys: &[&str]) {
    wait_until("the messages are held", PATIENCE, || {
        keys.iter().all(|k| {
            let o = outcomes(daemon, k);
            !o.is_empty() && o.iter().all(|o| o == "held")
        })
    });
}

/// The text of a Slack request.
fn text(r: &common::Request) -> String {
    r.json()["text"].as_str().unwrap_or_default().to_string()
}

/// Two locks expire during the window and one of them is taken again before it ends: nothing is
/// sent while the window is quiet; at its end one digest lists both, the one taken again marked
/// resolved, and history shows them held, then sent. Released once: nothing more comes.
#[test]
fn what_a_quiet_window_holds_goes_out_once_as_one_digest_at_its_end() {
    let redis = RedisServer::with_events("Exg");
    let (ahead, window) = closing_window(&redis, 1);
    let hook = HttpReceiver::start();
    let daemon = launch(redis, &rules(&window, &hook, &[("team", "digest")]), &ahead);
    daemon.expire_all(&["lock:1", "lock:2"]);
    wait_until_held(&daemon, &["lock:1", "lock:2"]);
    assert!(hook.requests().is_empty(), "sent during the quiet window");
    // What is held shows on the status page and in `keywatch_held`.
    let addr = common::endpoint(&daemon.process);
    let (_, metrics) = common::get(&addr, "/metrics");
    assert_eq!(
        common::metric(&metrics, "keywatch_held{channel=\"team\"}"),
        2.0,
        "{metrics}"
    );
    let (_, page) = common::get(&addr, "/");
    assert!(page.contains("held until"), "{page}");
    assert!(page.contains("2 messages"), "{page}");
    // Taken again while held: resolved by the release.
    let () = redis::cmd("SET")
        .arg("lock:2")
        .arg("again")
        .query(&mut daemon.conn())
        .unwrap();

    let got = hook.wait_for(1, RELEASED_WITHIN);
    let digest = text(&got[0]);
    assert!(
        digest.contains("2 messages held by quiet hours"),
        "{digest}"
    );
    assert!(digest.contains("Lock 1 expired."), "{digest}");
    assert!(digest.contains("(resolved) Lock 2 expired."), "{digest}");
    wait_until("the release is recorded", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0
            && ["lock:1", "lock:2"]
                .iter()
                .all(|k| outcomes(&daemon, k) == ["sent"])
    });
    assert_eq!(hook.requests().len(), 1, "released more than once");
}

/// `release: each` sends every held message on its own, saying it was held; `release: count`
/// one line of counts. A rule with `notify.quiet: ignore` is sent at once, quiet or not.
#[test]
fn each_sends_every_message_count_one_line_and_quiet_ignore_at_once() {
    let redis = RedisServer::with_events("Exg");
    let (ahead, window) = closing_window(&redis, 1);
    let hook = HttpReceiver::start();
    let daemon = launch(
        redis,
        &rules(&window, &hook, &[("each", "each"), ("count", "count")]),
        &ahead,
    );
    daemon.expire_all(&["lock:1", "lock:2", "urgent:9"]);
    // Ignored quiet hours: one message per channel, at once.
    let urgent = hook.wait_for(2, PATIENCE);
    assert!(
        urgent.iter().all(|r| text(r).contains("Urgent 9 expired.")),
        "{urgent:?}"
    );
    wait_until_held(&daemon, &["lock:1", "lock:2"]);
    assert_eq!(
        hook.requests().len(),
        2,
        "a held lock was sent during the window"
    );

    let got = hook.wait_for(5, RELEASED_WITHIN);
    let to = |channel: &str| -> Vec<String> {
        got.iter()
            .filter(|r| r.target == format!("/{channel}"))
            .map(text)
            .collect()
    };
    let each = to("each");
    assert_eq!(each.len(), 3, "{each:?}");
    for id in [1, 2] {
        assert!(
            each.iter()
                .any(|t| t.contains(&format!("Lock {id} expired."))
                    && t.contains("(held by quiet hours \"night\"")),
            "{each:?}"
        );
    }
    let count = to("count");
    assert_eq!(count.len(), 2, "{count:?}");
    assert!(
        count
            .iter()
            .any(|t| t.contains("2 messages held by quiet hours") && t.contains("lock 2")),
        "{count:?}"
    );
    wait_until("everything is released", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0
    });
    assert_eq!(hook.requests().len(), 5);
}

/// keywatch is killed (SIGKILL) while the window holds a message, and started again: the held
/// message is in Redis, and goes out once at the window's end. A second instance runs beside
/// it: one release between them.
#[test]
fn held_messages_survive_a_kill_and_two_instances_release_them_once() {
    let redis = RedisServer::with_events("Exg");
    let (ahead, window) = closing_window(&redis, 1);
    let hook = HttpReceiver::start();
    let mut daemon = launch(redis, &rules(&window, &hook, &[("team", "digest")]), &ahead);
    daemon.expire_all(&["lock:1"]);
    wait_until_held(&daemon, &["lock:1"]);
    daemon.process.sigkill();
    let envs = [("KEYWATCH_DRILL_QUIET_AHEAD", ahead.as_str())];
    daemon.process = run_subscribed(
        &daemon.redis.auth_url(),
        &daemon.rules.path,
        Logs::Json,
        &envs,
    );
    let _second = run_subscribed(
        &daemon.redis.auth_url(),
        &daemon.rules.path,
        Logs::Json,
        &envs,
    );
    let got = hook.wait_for(1, RELEASED_WITHIN);
    assert!(text(&got[0]).contains("Lock 1 expired."), "{got:?}");
    wait_until("the release is recorded", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0 && outcomes(&daemon, "lock:1") == ["sent"]
    });
    assert_eq!(hook.requests().len(), 1, "released more than once");
}

/// A reload that removes the window releases what it held at once, whatever its end was.
#[test]
fn a_reload_that_removes_the_window_releases_at_once() {
    let redis = RedisServer::with_events("Exg");
    // Ten minutes: far beyond the drill.
    let (ahead, window) = closing_window(&redis, 10);
    let hook = HttpReceiver::start();
    let mut daemon = launch(redis, &rules(&window, &hook, &[("team", "digest")]), &ahead);
    daemon.expire_all(&["lock:1"]);
    wait_until_held(&daemon, &["lock:1"]);
    assert!(hook.requests().is_empty());

    let without = rules("", &hook, &[("team", "digest")])
        .replace(", quiet: { during: night, release: digest }", "");
    std::fs::write(&daemon.rules.path, without).unwrap();
    daemon.process.sighup();
    let got = hook.wait_for(1, PATIENCE);
    assert!(text(&got[0]).contains("Lock 1 expired."), "{got:?}");
    wait_until("the release is recorded", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0
    });
}

/// Two instances (leases of 2 s) whose `channels` are quiet until about a minute from now, on a
/// receiver that answers each request after 6 s — three leases' worth, well within a channel's
/// timeout — with `lock:1` expired and held.
fn two_instances_behind_a_slow_hook(
    channels: &[(&str, &str)],
) -> (Daemon, common::KeywatchProcess, HttpReceiver) {
    let redis = RedisServer::with_events("Exg");
    let (ahead, window) = closing_window(&redis, 1);
    let hook = HttpReceiver::start();
    hook.set_handler(|_| Some(common::Response::ok_body("ok").delay(Duration::from_secs(6))));
    let envs = [
        ("KEYWATCH_DRILL_QUIET_AHEAD", ahead.as_str()),
        ("KEYWATCH_LEASE", "2s"),
    ];
    let daemon = Daemon::launch(
        redis,
        common::Rules::new(&rules(&window, &hook, channels)),
        Logs::Json,
        &envs,
    );
    let second = run_subscribed(
        &daemon.redis.auth_url(),
        &daemon.rules.path,
        Logs::Json,
        &envs,
    );
    daemon.expire_all(&["lock:1"]);
    wait_until_held(&daemon, &["lock:1"]);
    (daemon, second, hook)
}

/// A release whose digest takes longer than a lease (a slow target) keeps its lease while it
/// works: the other instance, watching the same window end, does not take the release over and
/// send the digest again.
#[test]
fn a_release_slower_than_its_lease_is_sent_once_by_two_instances() {
    let (daemon, _second, hook) = two_instances_behind_a_slow_hook(&[("team", "digest")]);
    hook.wait_for(1, RELEASED_WITHIN);
    // A second request would have come at the end of the first lease, while the first waited
    // for its answer: by the time the release is recorded it would be here.
    wait_until("the release is recorded", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0 && outcomes(&daemon, "lock:1") == ["sent"]
    });
    assert_eq!(hook.requests().len(), 1, "released more than once");
}

/// Two channels' quiet periods end together and each release is slower than the lease: the
/// instance that takes both must keep both leased while it sends the first, or the other instance
/// takes the second over and it is sent twice. Each channel gets its digest once.
#[test]
fn two_releases_slower_than_their_lease_are_each_sent_once_by_two_instances() {
    let (daemon, second, hook) =
        two_instances_behind_a_slow_hook(&[("team", "digest"), ("ops", "digest")]);
    hook.wait_for(2, RELEASED_WITHIN);
    // A second request for either would have come at the end of its first lease, while the
    // first waited for its answer: by the time both releases are recorded it would be here.
    wait_until("both releases are recorded", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0 && outcomes(&daemon, "lock:1") == ["sent", "sent"]
    });
    let mut paths: Vec<String> = hook
        .requests()
        .iter()
        .map(|r| r.path().to_string())
        .collect();
    paths.sort();
    // What each instance attempted and any lease it lost: why, should this ever fail.
    let said = |p: &common::KeywatchProcess| {
        p.describe_output()
            .lines()
            .filter(|l| {
                ["attempted", "release", "renew", "lease"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        paths,
        ["/ops", "/team"],
        "a channel's digest was sent more than once\n--- first instance ---\n{}\n--- second ---\n{}",
        said(&daemon.process),
        said(&second)
    );
}

/// A renewal of the release's lease still on its way to Redis when the release is recorded: on the
/// digest's request, once a renewal has landed (the group's score moved), Redis holds every write
/// (`CLIENT PAUSE … WRITE`, 1.5 s: within the renewed lease) and the digest is answered 0.9 s
/// later, after the next renewal (every 2/3 s) went out. That renewal and then the release's record
/// wait behind the pause, in that order. The release must be recorded with the renewed lease, not
/// refused as taken over and sent again when the renewal's lease runs out.
#[test]
fn a_renewal_on_its_way_when_the_release_is_recorded_sends_nothing_twice() {
    let (daemon, _second, hook) = two_instances_behind_a_slow_hook(&[("team", "digest")]);
    let url = daemon.redis.url();
    let paused = std::sync::atomic::AtomicBool::new(false);
    hook.set_handler(move |_| {
        // The first request only: a retake's would be refused the same way, again and again.
        if paused.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return Some(common::Response::ok_body("ok"));
        }
        let mut c = redis::Client::open(url.as_str())
            .and_then(|c| c.get_connection())
            .expect("connect to pause Redis");
        let score = |c: &mut redis::Connection| {
            redis::cmd("ZRANGE")
                .arg(&["keywatch:held", "0", "0", "WITHSCORES"])
                .query::<Vec<(String, f64)>>(c)
                .expect("the held groups")
        };
        let taken = score(&mut c);
        wait_until("a renewal of the release's lease", PATIENCE, || {
            score(&mut c) != taken
        });
        redis::cmd("CLIENT")
            .arg(&["PAUSE", "1500", "WRITE"])
            .exec(&mut c)
            .expect("CLIENT PAUSE");
        Some(common::Response::ok_body("ok").delay(Duration::from_millis(900)))
    });
    hook.wait_for(1, RELEASED_WITHIN);
    // A refused release leaves the messages held until the group, back when the renewal's lease
    // ran out, is sent and recorded again: nothing held means the second request, had there been
    // one, is here.
    wait_until("the release is recorded", PATIENCE, || {
        let o = outcomes(&daemon, "lock:1");
        held_in_redis(&daemon.redis) == 0 && !o.is_empty() && o.iter().all(|o| o == "sent")
    });
    assert_eq!(hook.requests().len(), 1, "released more than once");
    assert_eq!(outcomes(&daemon, "lock:1"), ["sent"]);
}

/// A digest the target refuses is tried again when the retry policy says, not when the release's
/// lease ends: after a `503` within about a second (the backoff's first step), after a `429` no
/// sooner than its `Retry-After` (5 s here, longer than the 2 s lease), and then sent once.
#[test]
fn a_refused_digest_is_retried_when_the_target_says_not_when_its_lease_ends() {
    let redis = RedisServer::with_events("Exg");
    let (ahead, window) = closing_window(&redis, 1);
    let hook = HttpReceiver::start();
    hook.push(common::Response::status(503));
    hook.push(common::Response::status(429).header("Retry-After", "5"));
    let daemon = Daemon::launch(
        redis,
        common::Rules::new(&rules(&window, &hook, &[("team", "digest")])),
        Logs::Json,
        &[
            ("KEYWATCH_DRILL_QUIET_AHEAD", ahead.as_str()),
            ("KEYWATCH_LEASE", "2s"),
        ],
    );
    daemon.expire_all(&["lock:1"]);
    wait_until_held(&daemon, &["lock:1"]);
    let got = hook.wait_for(3, RELEASED_WITHIN + Duration::from_secs(10));
    let gap = |i: usize| got[i].received_instant - got[i - 1].received_instant;
    // The backoff's first wait is between half a second and a second.
    assert!(
        gap(1) >= Duration::from_millis(500),
        "retried {:?} after a 503",
        gap(1)
    );
    assert!(
        gap(2) >= Duration::from_secs(5),
        "retried {:?} after a 429 with `Retry-After: 5` (the lease is 2 s)",
        gap(2)
    );
    assert!(
        got.iter().all(|r| text(r) == text(&got[0])),
        "the digest changed"
    );
    wait_until("the release is recorded", PATIENCE, || {
        held_in_redis(&daemon.redis) == 0 && outcomes(&daemon, "lock:1") == ["sent"]
    });
    assert_eq!(hook.requests().len(), 3, "sent again after it went out");
}
