//! `redis.cluster: true` end to end on a real Redis Cluster (3 masters, a replica each): every
//! master is subscribed, keys on every shard alert exactly once, alerts go on after a failover,
//! detail and cleanup reach keys on other shards, and readiness and metrics name every master.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{
    HttpReceiver, KeywatchProcess, Logs, PATIENCE, RedisCluster, Request, SUBSCRIBED, endpoint,
    get, set_and_expire_now, set_px, spawn_run, touch_until_gone, wait_until, write_rules,
};

/// Cluster settle and failover are slow on a loaded 2-core machine.
const CLUSTER_PATIENCE: Duration = Duration::from_secs(60);

fn cluster() -> RedisCluster {
    RedisCluster::builder()
        .masters(3)
        .replicas_per_master(1)
        .notify_keyspace_events("Exg")
        .start()
}

fn lock_rules(
    dir: &std::path::Path,
    receiver: &HttpReceiver,
    extra_rule: &str,
) -> std::path::PathBuf {
    let yaml = format!(
        "redis:\n  cluster: true\nchannels:\n  hook:\n    type: webhook\n    url: \"{}\"\nrules:\n  - name: lock-expired\n    match: \"lock:{{id}}\"\n    notify: {{ to: [hook] }}\n{extra_rule}",
        receiver.url_for("/hook")
    );
    write_rules(dir, "rules.yaml", &yaml)
}

/// A 3-master cluster with replicas, a webhook receiver, and keywatch running on it with the
/// lock rule plus `extra_rule`.
struct Setup {
    cluster: RedisCluster,
    receiver: HttpReceiver,
    _dir: tempfile::TempDir,
    kw: KeywatchProcess,
}

fn start(extra_rule: &str) -> Setup {
    let cluster = cluster();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = lock_rules(dir.path(), &receiver, extra_rule);
    let kw = run_on(&cluster, &rules);
    Setup {
        cluster,
        receiver,
        _dir: dir,
        kw,
    }
}

/// `keywatch run` on the cluster, seeded with one node, once every master is subscribed.
fn run_on(cluster: &RedisCluster, rules: &std::path::Path) -> KeywatchProcess {
    let kw = spawn_run(&cluster.seed_url(), rules, Logs::Text, &[]);
    let masters = cluster.masters().len();
    wait_until(
        "keywatch subscribed on every master",
        CLUSTER_PATIENCE,
        || kw.events(SUBSCRIBED).len() >= masters,
    );
    kw
}

/// Expires one key on each master, after the test's own keys, and returns the requests received
/// until every one of them is delivered, without them: whatever a test's keys were going to
/// cause on any shard (a duplicate) has arrived by then.
fn past_sentinels(cluster: &RedisCluster, receiver: &HttpReceiver) -> Vec<Request> {
    let mut c = conn(cluster);
    let sentinels: Vec<String> = cluster
        .masters()
        .iter()
        .map(|&m| cluster.key_on(m, "lock:sentinel"))
        .collect();
    for key in &sentinels {
        set_and_expire_now(&mut c, &[key]);
    }
    receiver.wait_past(&sentinels, CLUSTER_PATIENCE)
}

fn conn(cluster: &RedisCluster) -> redis::cluster::ClusterConnection {
    cluster
        .client()
        .get_connection()
        .expect("cluster connection")
}

/// Keys of the webhook requests received, with how often each came.
fn delivered(requests: &[Request]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in requests {
        *out.entry(r.json()["key"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    out
}

/// `keywatch_subscriber_up` per node, from `/metrics`.
fn subscribers_up(addr: &str) -> BTreeMap<String, i64> {
    let (_, body) = get(addr, "/metrics");
    body.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("keywatch_subscriber_up{node=\"")?;
            let (node, value) = rest.split_once("\"} ")?;
            Some((node.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

fn master_addrs(cluster: &RedisCluster) -> Vec<String> {
    cluster
        .masters()
        .iter()
        .map(|&i| format!("127.0.0.1:{}", cluster.node(i).port()))
        .collect()
}

#[test]
fn keys_on_every_shard_alert_once_and_every_master_is_ready() {
    let Setup {
        cluster,
        receiver,
        kw,
        _dir,
    } = start("");
    let addr = endpoint(&kw);

    // (d) readiness and the gauge name every master, and only masters.
    wait_until("/readyz says ready", PATIENCE, || {
        get(&addr, "/readyz").0 == 200
    });
    let masters = master_addrs(&cluster);
    let expected: BTreeMap<String, i64> = masters.iter().map(|m| (m.clone(), 1)).collect();
    wait_until(
        "keywatch_subscriber_up is 1 for every master",
        PATIENCE,
        || subscribers_up(&addr) == expected,
    );

    // (a) two keys on each master; nobody reads them: the ledger's poke expires them.
    let mut c = conn(&cluster);
    let mut keys = Vec::new();
    for &m in &cluster.masters() {
        for prefix in ["lock:a", "lock:b"] {
            let key = cluster.key_on(m, prefix);
            set_px(&mut c, &key, 1500);
            keys.push(key);
        }
    }
    receiver.wait_for(keys.len(), CLUSTER_PATIENCE);
    let d = delivered(&past_sentinels(&cluster, &receiver));
    let want: BTreeMap<String, usize> = keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(d, want, "{}", kw.describe_output());
    // The state lives in the cluster under one hash tag.
    let size = common::ledger::len(&mut c, "{keywatch}:");
    assert_eq!(size, 0, "every deadline was handled");
}

#[test]
fn alerts_continue_after_a_master_fails_over() {
    let Setup {
        cluster,
        receiver,
        kw,
        _dir,
    } = start("");
    let addr = endpoint(&kw);
    let mut c = conn(&cluster);

    let old_master = cluster.masters()[0];
    let replica = cluster.replicas_of(old_master)[0];
    // Set before the failover, due after it: the ledger knows its deadline.
    let before = cluster.key_on(old_master, "lock:before");
    set_px(&mut c, &before, 8000);
    wait_until("the ledger knows the deadline", PATIENCE, || {
        let n = common::ledger::len(&mut conn(&cluster), "{keywatch}:");
        n == 1
    });

    cluster.failover_takeover(replica);
    let new_master = format!("127.0.0.1:{}", cluster.node(replica).port());
    let old = format!("127.0.0.1:{}", cluster.node(old_master).port());
    wait_until(
        "the promoted replica is subscribed and the old master no longer watched",
        CLUSTER_PATIENCE,
        || {
            let up = subscribers_up(&addr);
            up.get(&new_master) == Some(&1) && !up.contains_key(&old)
        },
    );
    wait_until("/readyz says ready", PATIENCE, || {
        get(&addr, "/readyz").0 == 200
    });

    let mut c = conn(&cluster);
    let after = cluster.key_on(replica, "lock:after");
    set_px(&mut c, &after, 1500);
    receiver.wait_for(2, CLUSTER_PATIENCE);
    let d = delivered(&past_sentinels(&cluster, &receiver));
    let want: BTreeMap<String, usize> = [(before, 1), (after, 1)].into_iter().collect();
    assert_eq!(d, want, "{}", kw.describe_output());
}

#[test]
fn detail_and_cleanup_reach_keys_on_other_shards() {
    let rule = "  - name: task\n    match: \"task:{id}\"\n    detail: { key: \"detail:{{ id }}\", remove: true }\n    cleanup:\n      delete: [\"session:{{ id }}:*\", \"cart:{{ id }}\"]\n      hdel: [{ key: \"online\", field: \"{{ id }}\" }]\n    notify: { to: [hook] }\n";
    let Setup {
        cluster,
        receiver,
        kw,
        _dir,
    } = start(rule);
    let mut c = conn(&cluster);

    // Related keys spread over the shards: enough session keys that every master holds some.
    let id = "42";
    let _: () = redis::cmd("SET")
        .arg(format!("detail:{id}"))
        .arg(r#"{"order": 42}"#)
        .query(&mut c)
        .unwrap();
    let sessions: Vec<String> = (0..30).map(|i| format!("session:{id}:{i}")).collect();
    let mut shards = std::collections::BTreeSet::new();
    for s in &sessions {
        let _: () = redis::cmd("SET").arg(s).arg("x").query(&mut c).unwrap();
        shards.insert(cluster.master_for_key(s));
    }
    assert_eq!(shards.len(), 3, "the session keys span every master");
    let _: () = redis::cmd("SET")
        .arg(format!("cart:{id}"))
        .arg("x")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("online")
        .arg(id)
        .arg("1")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("session:7:0")
        .arg("other")
        .query(&mut c)
        .unwrap();

    set_px(&mut c, format!("task:{id}"), 1000);
    let got = receiver.wait_for(1, CLUSTER_PATIENCE);
    assert_eq!(
        got[0].json()["detail"],
        serde_json::json!({"order": 42}),
        "{}",
        kw.describe_output()
    );
    wait_until("the related keys are gone", PATIENCE, || {
        let mut c = conn(&cluster);
        let left: usize = sessions
            .iter()
            .chain([format!("cart:{id}"), format!("detail:{id}")].iter())
            .map(|k| {
                redis::cmd("EXISTS")
                    .arg(k)
                    .query::<usize>(&mut c)
                    .unwrap_or(1)
            })
            .sum();
        let field: usize = redis::cmd("HEXISTS")
            .arg("online")
            .arg(id)
            .query(&mut c)
            .unwrap_or(1);
        left + field == 0
    });
    let other: usize = redis::cmd("EXISTS")
        .arg("session:7:0")
        .query(&mut c)
        .unwrap();
    assert_eq!(other, 1, "another session's keys stay");
}

/// `keywatch CMD ... -r RULES --redis SEED` → (exit code, stdout, stderr).
fn cli(cluster: &RedisCluster, rules: &std::path::Path, args: &[&str]) -> (i32, String, String) {
    let mut all: Vec<&str> = args.to_vec();
    let url = cluster.seed_url();
    all.extend(["-r", rules.to_str().unwrap(), "--redis", &url]);
    let out = common::run_keywatch(all, &[]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn silence_dead_and_upcoming_work_against_a_cluster() {
    let cluster = RedisCluster::builder()
        .masters(3)
        .notify_keyspace_events("Exg")
        .start();
    let receiver = HttpReceiver::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = lock_rules(dir.path(), &receiver, "");

    let (code, out, err) = cli(
        &cluster,
        &rules,
        &[
            "silence",
            "add",
            "--rule",
            "lock-expired",
            "--for",
            "1h",
            "--comment",
            "drill",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&cluster, &rules, &["silence", "list"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("lock-expired") && out.contains("drill"),
        "{out}"
    );
    let mut c = conn(&cluster);
    let stored: usize = redis::cmd("HLEN")
        .arg("{keywatch}:silences")
        .query(&mut c)
        .unwrap();
    assert_eq!(stored, 1, "silences live under the hash-tagged prefix");
    let (code, out, err) = cli(&cluster, &rules, &["dead", "list"]);
    assert_eq!(code, 0, "{out}{err}");

    // No ledger yet: `upcoming` SCANs every master.
    let mut keys: Vec<String> = cluster
        .masters()
        .iter()
        .map(|&m| cluster.key_on(m, "lock:u"))
        .collect();
    for k in &keys {
        set_px(&mut c, k, 600_000);
    }
    let (code, out, err) = cli(&cluster, &rules, &["upcoming", "--within", "1h", "--json"]);
    assert_eq!(code, 0, "{out}{err}");
    let mut listed: Vec<String> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["key"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    listed.sort();
    keys.sort();
    assert_eq!(listed, keys);
}

#[test]
fn check_rejects_other_databases_on_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let rules = write_rules(
        dir.path(),
        "rules.yaml",
        "redis:\n  cluster: true\n  databases: [0, 1]\nchannels:\n  log: { type: log }\nrules:\n  - name: r\n    match: \"a:{x}\"\n    notify: { to: [log] }\n",
    );
    let out = common::run_keywatch(["check", "-r", rules.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("rules.yaml:3:") && err.contains("a Redis Cluster has only database 0"),
        "{err}"
    );
}

#[test]
fn expiries_on_every_shard_while_keywatch_is_down_are_recovered_once() {
    let Setup {
        cluster,
        receiver,
        mut kw,
        _dir,
    } = start("");
    let mut c = conn(&cluster);
    let mut keys = Vec::new();
    for &m in &cluster.masters() {
        for prefix in ["lock:r", "lock:s", "lock:t"] {
            let key = cluster.key_on(m, prefix);
            set_px(&mut c, &key, 3000);
            keys.push(key);
        }
    }
    wait_until("the ledger knows every deadline", PATIENCE, || {
        let n = common::ledger::len(&mut conn(&cluster), "{keywatch}:");
        n == keys.len() as i64
    });
    kw.sigkill();
    // Let every key expire with nobody listening: touching them until they are gone makes their
    // master delete them as soon as their TTL has passed.
    touch_until_gone(&mut c, &keys);
    for k in &keys {
        let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut c).unwrap();
        assert_eq!(ttl, -2, "{k}");
    }
    assert_eq!(receiver.count(), 0);

    let rules = _dir.path().join("rules.yaml");
    let kw = run_on(&cluster, &rules);
    receiver.wait_for(keys.len(), CLUSTER_PATIENCE);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for r in past_sentinels(&cluster, &receiver) {
        let j = r.json();
        assert_eq!(j["recovered"], true, "{j}");
        *seen
            .entry(j["key"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    let want: BTreeMap<String, usize> = keys.iter().map(|k| (k.clone(), 1)).collect();
    assert_eq!(seen, want, "{}", kw.describe_output());
}
