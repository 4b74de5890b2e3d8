//! Keys as long as Redis allows, end to end (docs/reliability.md#bounded-whatever-the-key): the
//! real binary on a real `redis-server`, every type of channel to local receivers (HTTP, SMTP),
//! signed links and an escalation, and keywatch's memory read from `/proc` while it works.
//!
//! Key names are anyone's who can write a key: a 16 MB one must neither take keywatch's memory
//! with it nor make a request its service refuses, and its links must still work.

use crate::common;

use std::collections::BTreeMap;

use common::daemon::Logs;
use common::{
    Daemon, HttpReceiver, KeywatchProcess, PATIENCE, RedisCluster, Request, Response, Rules,
    SmtpServer,
};
use serde_json::{Value, json};

/// How far keywatch's peak resident memory may rise above its idle one while it handles long
/// keys (docs/reliability.md#bounded-whatever-the-key): 100 MiB, for one 16 MiB key as for eight
/// 2 MiB keys at once and through a reconnect, against redis-server as against Valkey.
const BOUND_MIB: f64 = 100.0;

/// A field of `/proc/PID/status` (`VmRSS:`, `VmHWM:`), in MiB.
fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc");
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    kb / 1024.0
}

const PD_KEY: &str = "R0UTINGkey0123456789abcdefABCDEF";
const TG_TOKEN: &str = "123456:TGtoken-0123456789abcdef";

/// Each HTTP channel's path on the one receiver, and the service's documented limit on what
/// it takes (docs/how-it-works.md#message-size): the whole body, or (WeCom, Telegram, Slack)
/// the text part named by the pointer.
const HTTP_CHANNELS: &[(&str, &str, usize, Option<&str>)] = &[
    ("ding", "/ding", 20_000, None),
    ("slack", "/slack", 40_000, Some("/text")),
    ("feishu", "/feishu", 20_000, None),
    ("wecom", "/wecom", 4_096, Some("/markdown/content")),
    ("hook", "/hook", 1 << 20, None),
    ("am", "/am/api/v2/alerts", 1 << 20, None),
    ("teams", "/teams", 28_000, None),
    ("tg", "/bot", 4_096, Some("/text")),
    ("pd", "/pd", 512_000, None),
];

/// The receiver of every HTTP channel, answering each as its service does.
fn services() -> HttpReceiver {
    let r = HttpReceiver::start();
    r.set_handler(|req| {
        let path = req.path().to_string();
        Some(match path.as_str() {
            "/ding" | "/wecom" => Response::json(&json!({"errcode": 0, "errmsg": "ok"})),
            "/feishu" => Response::json(&json!({"code": 0, "msg": "success", "data": {}})),
            "/slack" => Response::ok_body("ok"),
            "/teams" => Response::status(202),
            "/pd" => Response::status(202)
                .header("Content-Type", "application/json")
                .body(json!({"status": "success", "message": "Event processed"}).to_string()),
            p if p.starts_with("/bot") => {
                Response::json(&json!({"ok": true, "result": {"message_id": 1}}))
            }
            _ => Response::status(200),
        })
    });
    r
}

/// Rules with every type of channel, to `http` and `smtp`, signed links, and one rule on
/// `long:{id}` sending to all of them, with an escalation.
fn every_channel(http: &HttpReceiver, smtp: &SmtpServer) -> String {
    let u = |p: &str| http.url_for(p);
    format!(
        r#"
links:
  base_url: "http://kw.test"
  secret: "0123456789abcdef0123"
channels:
  ding: {{ type: dingtalk, url: "{ding}", rate: 100/s }}
  slack: {{ type: slack, url: "{slack}", rate: 100/s }}
  feishu: {{ type: feishu, url: "{feishu}", msgtype: markdown, rate: 100/s }}
  wecom: {{ type: wecom, url: "{wecom}", msgtype: markdown, rate: 100/s }}
  hook: {{ type: webhook, url: "{hook}" }}
  am: {{ type: alertmanager, urls: ["{am}"] }}
  teams: {{ type: teams, url: "{teams}", rate: 100/s }}
  tg: {{ type: telegram, url: "{base}", token: "{TG_TOKEN}", chat_id: -100123, rate: 100/s }}
  pd: {{ type: pagerduty, url: "{pd}", routing_key: "{PD_KEY}", rate: 100/s }}
  mail: {{ type: email, smtp: "smtp://127.0.0.1:{smtp}", tls: none, from: "kw <kw@example.com>", to: oncall@example.com, rate: 100/s }}
  log: {{ type: log }}
rules:
  - name: long
    match: "long:{{id}}"
    notify:
      to: [ding, slack, feishu, wecom, hook, am, teams, tg, pd, mail, log]
      title: "Lock {{{{ id }}}} expired"
      message: "{{{{ key }}}} expired: order {{{{ id }}}} ({{{{ captures }}}})."
    escalate: {{ after: 1h, to: [log] }}
"#,
        ding = u("/ding"),
        slack = u("/slack"),
        feishu = u("/feishu"),
        wecom = u("/wecom"),
        hook = u("/hook"),
        am = u("/am"),
        teams = u("/teams"),
        base = http.url(),
        pd = u("/pd"),
        smtp = smtp.port(),
    )
}

/// keywatch with [`every_channel`] on a [`long_key_server`], subscribed.
fn launch(http: &HttpReceiver, smtp: &SmtpServer) -> Daemon {
    Daemon::launch(
        long_key_server(),
        Rules::new(&every_channel(http, smtp)),
        Logs::Json,
        &[],
    )
}

/// The services, keywatch on its own server with a rule on every channel, and its idle RSS.
fn started() -> (HttpReceiver, SmtpServer, Daemon, f64) {
    let http = services();
    let smtp = SmtpServer::start();
    let daemon = launch(&http, &smtp);
    let idle = idle_rss(&daemon.process);
    (http, smtp, daemon, idle)
}

/// Fails unless the peak RSS is within [`BOUND_MIB`] of the idle one (MiB both).
fn within_bound(idle: f64, peak: f64) {
    assert!(
        peak - idle <= BOUND_MIB,
        "peak RSS {peak:.1} MiB is {:.1} MiB above idle {idle:.1} MiB",
        peak - idle
    );
}

/// Reads the daemon's peak RSS, shows it beside `idle` under `what`, and fails unless it is
/// within the bound ([`within_bound`]).
fn peak_within_bound(what: &str, process: &KeywatchProcess, idle: f64) {
    let peak = status_mib(process.pid(), "VmHWM:");
    println!(
        "{what}: idle {idle:.1} MiB, peak {peak:.1} MiB ({:.1} above)",
        peak - idle
    );
    within_bound(idle, peak);
}

/// The daemon's resident memory once it is up and has nothing to do, MiB.
fn idle_rss(process: &KeywatchProcess) -> f64 {
    let addr = common::endpoint(process);
    common::wait_until("keywatch ready", PATIENCE, || {
        common::get(&addr, "/readyz").0 == 200
    });
    status_mib(process.pid(), "VmRSS:")
}

/// A server whose subscribers may fall 64 MB behind: Redis's default pubsub limit (32 MB) closes
/// keywatch's subscription when the `expire` and `expired` events of a 16 MB key wait in it
/// together (docs/redis.md#keys-of-megabytes).
fn long_key_server() -> common::RedisServer {
    common::RedisServer::builder()
        .notify_keyspace_events("Exg")
        .config("client-output-buffer-limit", "pubsub 256mb 64mb 60")
        .start()
}

/// `key` set to a short value and expired now, without sending its 16 MB name twenty times
/// (each `PTTL` of [`common::expire_now`] carries it): one `SET … PX`, then one read once it
/// is due, which makes Redis delete it and publish `expired`.
fn expire_long(daemon: &Daemon, key: &[u8]) {
    let mut conn = daemon.conn();
    let () = redis::cmd("SET")
        .arg(key)
        .arg("v")
        .arg("PX")
        .arg(200)
        .query(&mut conn)
        .expect("SET");
    common::wait_until("the long key is due", PATIENCE, || {
        let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
        ttl == -2
    });
}

/// Sets `key` to live `px` ms and waits until keywatch's ledger holds its deadline.
fn set_learnt(conn: &mut impl redis::ConnectionLike, key: &[u8], px: i64) {
    set_learnt_under(conn, "keywatch:", key, px)
}

/// [`set_learnt`] with the state under `prefix`.
fn set_learnt_under(conn: &mut impl redis::ConnectionLike, prefix: &str, key: &[u8], px: i64) {
    let () = redis::cmd("SET")
        .arg(key)
        .arg("v")
        .arg("PX")
        .arg(px)
        .query(conn)
        .expect("SET");
    common::wait_until("keywatch learnt the long key's deadline", PATIENCE, || {
        common::ledger::len(conn, prefix) == 1
    });
}

/// `key` set and learnt, its deadline moved by `PEXPIRE` (the ledger takes the old one out of
/// its second's hash, which names the key too), then dropped by `PERSIST`; returns once the
/// ledger under `prefix` has followed both.
fn moved_then_dropped(conn: &mut impl redis::ConnectionLike, prefix: &str, key: &str) {
    set_learnt_under(conn, prefix, key.as_ref(), 600_000);
    let first = common::ledger::deadline(conn, prefix, key).unwrap();
    let _: i64 = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(1_200_000)
        .query(conn)
        .expect("PEXPIRE");
    common::wait_until("the deadline moved in the ledger", PATIENCE, || {
        common::ledger::deadline(conn, prefix, key).is_some_and(|d| d > first + 300_000)
    });
    let _: i64 = redis::cmd("PERSIST").arg(key).query(conn).expect("PERSIST");
    common::wait_until("the deadline left the ledger", PATIENCE, || {
        common::ledger::len(conn, prefix) == 0
    });
}

/// The requests of `http` once there are `n`, showing keywatch's log if they do not come.
fn delivered(process: &KeywatchProcess, http: &HttpReceiver, n: usize) -> Vec<Request> {
    common::poll(
        &format!("{n} requests"),
        PATIENCE * 6,
        || {
            let got = http.requests();
            (got.len() >= n).then_some(got)
        },
        || {
            let log = process.stderr();
            let tail: String = log
                .chars()
                .rev()
                .take(6000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            format!("{} requests; log: …{tail}", http.count())
        },
    )
}

/// Every request of each HTTP channel, by channel name.
fn by_channel(requests: &[Request]) -> BTreeMap<&'static str, Vec<Request>> {
    let mut out: BTreeMap<&'static str, Vec<Request>> = BTreeMap::new();
    for r in requests {
        let name = HTTP_CHANNELS
            .iter()
            .find(|(_, p, ..)| r.path().starts_with(p))
            .map(|(n, ..)| *n)
            .unwrap_or("?");
        out.entry(name).or_default().push(r.clone());
    }
    out
}

/// The size each channel's request counts against its service's limit.
fn measured(name: &str, r: &Request) -> usize {
    let (_, _, _, part) = HTTP_CHANNELS.iter().find(|(n, ..)| *n == name).unwrap();
    match part {
        None => r.body.len(),
        Some(pointer) => {
            let text = r.json().pointer(pointer).cloned().unwrap_or(Value::Null);
            let text = text.as_str().unwrap_or_default();
            // Telegram counts characters after its HTML is parsed (tags are none, an entity
            // is one), Slack characters; the others bytes.
            match name {
                "tg" => visible(text),
                "slack" => text.chars().count(),
                _ => text.len(),
            }
        }
    }
}

/// The characters Telegram counts in HTML text: none for a tag, one for an entity.
fn visible(html: &str) -> usize {
    let mut n = 0;
    let mut rest = html;
    while let Some(c) = rest.chars().next() {
        let skip = match c {
            '<' => rest.find('>').map(|e| (e + 1, 0)),
            '&' => rest.find(';').filter(|e| *e < 10).map(|e| (e + 1, 1)),
            _ => None,
        };
        let (len, count) = skip.unwrap_or((c.len_utf8(), c.len_utf16()));
        n += count;
        rest = &rest[len..];
    }
    n
}

/// The acknowledge and silence tokens of a DingTalk markdown text (`[Acknowledge](…/l/TOKEN)`).
fn link_tokens(text: &str) -> Vec<String> {
    text.match_indices("/l/")
        .map(|(i, _)| {
            text[i + 3..]
                .split(|c: char| c == ')' || c.is_whitespace())
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

/// A 16 MB key on a rule with every type of channel, links and an escalation: keywatch's
/// memory stays within [`BOUND_MIB`] of its idle memory, every channel gets exactly one message
/// within its service's limit with the key cut and marked, and both links act on the event.
#[test]
fn a_16_mb_key_reaches_every_channel_within_limits_and_bounded_memory() {
    let (http, smtp, daemon, idle) = started();
    let mut key = b"long:".to_vec();
    key.extend(std::iter::repeat_n(b'k', 16 << 20));
    expire_long(&daemon, &key);

    let requests = delivered(&daemon.process, &http, HTTP_CHANNELS.len());
    let mails = smtp.wait_for_mails(1, PATIENCE * 6);
    daemon.attempt_on("log", "sent");
    let peak = status_mib(daemon.process.pid(), "VmHWM:");

    // Everything measured first and printed, then judged.
    let got = by_channel(&http.requests());
    let mut sizes = Vec::new();
    let mut wrong = Vec::new();
    for (name, _, limit, _) in HTTP_CHANNELS {
        let rs = got.get(name).cloned().unwrap_or_default();
        if rs.len() != 1 {
            wrong.push(format!("{name}: {} requests", rs.len()));
        }
        let Some(r) = rs.first() else { continue };
        let size = measured(name, r);
        sizes.push(format!(
            "{name} {size} (limit {limit}, body {})",
            r.body.len()
        ));
        if size > *limit {
            wrong.push(format!("{name}: {size} > {limit}"));
        }
        if !r.body_str().contains("16777221 bytes") {
            wrong.push(format!("{name}: the cut key does not say its length"));
        }
    }
    sizes.push(format!("mail {} (limit {})", mails[0].raw.len(), 1 << 20));
    if mails.len() != 1 || mails[0].raw.len() > 1 << 20 {
        wrong.push(format!(
            "mail: {} mails, {} bytes",
            mails.len(),
            mails[0].raw.len()
        ));
    }
    println!(
        "idle {idle:.1} MiB, peak {peak:.1} MiB ({:.1} above); sizes: {}",
        peak - idle,
        sizes.join(", ")
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert!(requests.len() >= HTTP_CHANNELS.len());

    // Both links act on the event, through keywatch's endpoint.
    let ding = &got["ding"][0].json();
    let tokens = link_tokens(ding["markdown"]["text"].as_str().unwrap_or_default());
    assert_eq!(tokens.len(), 2, "{ding:.400}");
    for t in &tokens {
        assert!(
            t.len() < 400,
            "a link's length does not depend on the key: {}",
            t.len()
        );
    }
    let addr = common::endpoint(&daemon.process);
    for t in &tokens {
        let (status, page) = common::post(&addr, &format!("/l/{t}"));
        assert_eq!(status, 200, "{page}");
    }
    let id = got["hook"][0].json()["id"].as_str().unwrap().to_string();
    let mut conn = daemon.conn();
    let acked: i64 = redis::cmd("EXISTS")
        .arg(format!("keywatch:ack:{id}"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(acked, 1, "the acknowledge link acknowledged the alert");
    let out = daemon
        .rules
        .run(&["silence", "list", "--redis", &daemon.redis.url()], &[]);
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("long"),
        "the silence link silenced the rule: {list}"
    );
    // Memory last, so that everything else is seen whatever it says.
    within_bound(idle, peak);
    daemon.stop();
}

/// A 16 MB key present while keywatch's connections to Redis are cut and come back, then
/// expiring: the reconnect's walk of the ledger and its fill read the key (docs/reliability.md#bounded-whatever-the-key),
/// and keywatch's memory stays within [`BOUND_MIB`] of its idle memory through all of it.
#[test]
fn a_16_mb_key_through_a_reconnect_stays_within_the_bound() {
    let (http, smtp, daemon, idle) = started();
    let addr = common::endpoint(&daemon.process);
    let scanned = || {
        common::metric(
            &common::get(&addr, "/metrics").1,
            "keywatch_scan_keys_total",
        )
    };
    let before = scanned();
    let mut key = b"long:".to_vec();
    key.extend(std::iter::repeat_n(b'k', 16 << 20));
    let mut conn = daemon.conn();
    // Due well after the reconnect, whose walk and fill must find it there.
    set_learnt(&mut conn, key.as_ref(), 8000);
    daemon.redis.cut_clients();
    daemon.wait_for_events("subscribed", 2, "after the reconnect", |_| true);
    common::wait_until("the reconnect's fill read the long key", PATIENCE, || {
        scanned() > before
    });
    // The poker touches it at its deadline: Redis expires it and publishes `expired`.
    delivered(&daemon.process, &http, HTTP_CHANNELS.len());
    smtp.wait_for_mails(1, PATIENCE * 6);
    daemon.attempt_on("log", "sent");
    peak_within_bound("reconnect", &daemon.process, idle);
    daemon.stop();
}

/// A long key's deadline moved, then dropped: the ledger takes the old deadline out of its
/// second's hash each time, which names the key too.
#[test]
fn a_16_mb_key_whose_deadline_moves_and_goes_stays_within_the_bound() {
    let (_http, _smtp, daemon, idle) = started();
    let key = format!("long:{}", "k".repeat(16 << 20));
    moved_then_dropped(&mut daemon.conn(), "keywatch:", &key);
    peak_within_bound("moved and gone", &daemon.process, idle);
    daemon.stop();
}

/// A long key whose `expired` never comes (notifications off for a moment): the poker finds it
/// gone, moves it to the poked set after its grace, and it is recovered.
#[test]
fn a_16_mb_key_found_gone_and_recovered_stays_within_the_bound() {
    let (http, smtp, daemon, idle) = started();
    let key = format!("long:{}", "k".repeat(16 << 20));
    let mut conn = daemon.conn();
    // Expired without a keyevent: the poker's touch finds it gone. Only `expired` is off, from
    // before the key is set: turned off once the ledger had learnt it, it came too late on a
    // busy machine, after the deadline.
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg("Eg")
        .query(&mut conn)
        .expect("CONFIG SET");
    set_learnt(&mut conn, key.as_ref(), 3_000);
    common::wait_until("the long key expired unannounced", PATIENCE, || {
        let left: i64 = redis::cmd("EXISTS").arg(&key).query(&mut conn).unwrap();
        left == 0
    });
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("notify-keyspace-events")
        .arg("Exg")
        .query(&mut conn)
        .expect("CONFIG SET");
    let got = delivered(&daemon.process, &http, HTTP_CHANNELS.len());
    assert!(
        got.iter()
            .any(|r| r.body_str().contains("\"recovered\":true")),
        "recovered"
    );
    smtp.wait_for_mails(1, PATIENCE * 6);
    peak_within_bound("found gone", &daemon.process, idle);
    daemon.stop();
}

/// Eight 2 MB keys at once: within the same bound as one.
#[test]
fn eight_2_mb_keys_at_once_stay_within_the_bound() {
    let (http, smtp, daemon, idle) = started();
    let keys: Vec<Vec<u8>> = (0..8u8)
        .map(|i| {
            let mut k = format!("long:{i}").into_bytes();
            k.extend(std::iter::repeat_n(b'k', 2 << 20));
            k
        })
        .collect();
    let mut conn = daemon.conn();
    let mut pipe = redis::pipe();
    for k in &keys {
        pipe.cmd("SET").arg(k).arg("v").arg("PX").arg(200).ignore();
    }
    let () = pipe.query(&mut conn).unwrap();
    common::wait_until("the long keys are due", PATIENCE, || {
        keys.iter().all(|k| {
            let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).unwrap();
            ttl == -2
        })
    });
    delivered(&daemon.process, &http, HTTP_CHANNELS.len() * 8);
    smtp.wait_for_mails(8, PATIENCE * 6);
    peak_within_bound("eight 2 MiB keys", &daemon.process, idle);
    for (name, rs) in by_channel(&http.requests()) {
        assert_eq!(rs.len(), 8, "{name}");
        for r in rs {
            let size = measured(name, &r);
            let (_, _, limit, _) = HTTP_CHANNELS.iter().find(|(n, ..)| *n == name).unwrap();
            assert!(size <= *limit, "{name}: {size} > {limit}");
        }
    }
    daemon.stop();
}

/// On a Redis Cluster, a 16 MB key whose deadline moves, goes, and then comes back and expires:
/// the ledger's writes that name the key go on connections of their own to the master of the
/// slot they write (docs/reliability.md#bounded-whatever-the-key), not through the cluster
/// connection every command shares, and every channel gets its one message.
#[test]
fn on_a_cluster_a_16_mb_key_whose_deadline_moves_goes_and_expires_stays_within_the_bound() {
    let cluster = RedisCluster::builder()
        .masters(3)
        .notify_keyspace_events("Exg")
        .config("client-output-buffer-limit", "pubsub 256mb 64mb 60")
        .start();
    let http = services();
    let smtp = SmtpServer::start();
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!("redis:\n  cluster: true\n{}", every_channel(&http, &smtp));
    let rules = common::write_rules(dir.path(), "rules.yaml", &yaml);
    let mut kw = common::spawn_run(&cluster.seed_url(), &rules, common::Logs::Json, &[]);
    kw.wait_for_events(common::SUBSCRIBED, 3, "on every master", |_| true);
    let idle = idle_rss(&kw);
    let mut conn = cluster
        .client()
        .get_connection()
        .expect("cluster connection");
    let key = format!("long:{}", "k".repeat(16 << 20));
    moved_then_dropped(&mut conn, "{keywatch}:", &key);
    let _: i64 = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(3_000)
        .query(&mut conn)
        .expect("PEXPIRE");
    delivered(&kw, &http, HTTP_CHANNELS.len());
    smtp.wait_for_mails(1, PATIENCE * 6);
    peak_within_bound("cluster", &kw, idle);
    for (name, rs) in by_channel(&http.requests()) {
        assert_eq!(rs.len(), 1, "{name}");
    }
    kw.stop();
}

/// A 16 MB key the scanner warns about before its deadline, walked again every second: the
/// warning's claim names the key by its SHA-256, and the walk's pages and `PEXPIRETIME`s go on
/// connections of their own (docs/reliability.md#bounded-whatever-the-key); it is warned once.
#[test]
fn a_16_mb_key_the_scanner_warns_about_stays_within_the_bound() {
    let http = services();
    let smtp = SmtpServer::start();
    let yaml = format!(
        "{}  - name: long-soon\n    match: \"long:{{id}}\"\n    on: [expiring]\n    warn_before: 1h\n    notify: {{ to: [hook] }}\nscanner:\n  schedule: \"@every 1s\"\n",
        every_channel(&http, &smtp)
    );
    let daemon = Daemon::launch(long_key_server(), Rules::new(&yaml), Logs::Json, &[]);
    let idle = idle_rss(&daemon.process);
    let addr = common::endpoint(&daemon.process);
    let scanned = || {
        common::metric(
            &common::get(&addr, "/metrics").1,
            "keywatch_scan_keys_total",
        )
    };
    let key = format!("long:{}", "k".repeat(16 << 20));
    set_learnt(&mut daemon.conn(), key.as_ref(), 1_800_000);
    let warned = delivered(&daemon.process, &http, 1);
    assert!(
        warned[0].path().starts_with("/hook"),
        "{}",
        warned[0].path()
    );
    // Three more walks that read the key.
    let after = scanned();
    common::wait_until("three more walks", PATIENCE, || scanned() >= after + 3.0);
    peak_within_bound("scanner", &daemon.process, idle);
    assert_eq!(http.count(), 1, "one warning");
    daemon.stop();
}

/// A 16 MB key whose rule's cleanup names it in every target: a `SCAN` glob walked over a
/// keyspace of 5,000 keys, a key to `UNLINK` and a hash field to `HDEL`. The commands that carry
/// its 16 MB stay within the bound, and the field named by the exact bytes goes. (The related
/// keys do not exist: deleting a key of 16 MB would bring its own `del` event.)
#[test]
fn a_16_mb_key_s_cleanup_stays_within_the_bound() {
    let http = services();
    let yaml = format!(
        r#"
channels:
  hook: {{ type: webhook, url: "{hook}" }}
rules:
  - name: long
    match: "long:{{id}}"
    cleanup:
      delete: ["side:{{{{ id }}}}:*", "cart:{{{{ id }}}}"]
      hdel: [{{ key: "online", field: "{{{{ id }}}}" }}]
    notify: {{ to: [hook] }}
"#,
        hook = http.url_for("/hook")
    );
    let daemon = Daemon::launch(long_key_server(), Rules::new(&yaml), Logs::Json, &[]);
    let idle = idle_rss(&daemon.process);
    let id = "k".repeat(16 << 20);
    let mut conn = daemon.conn();
    let mut pipe = redis::pipe();
    for i in 0..5_000 {
        pipe.cmd("SET").arg(format!("side:{i}")).arg("v").ignore();
    }
    pipe.cmd("HSET").arg("online").arg(&id).arg("v").ignore();
    pipe.cmd("HSET")
        .arg("online")
        .arg("someone")
        .arg("v")
        .ignore();
    let () = pipe.query(&mut conn).unwrap();
    expire_long(&daemon, format!("long:{id}").as_bytes());
    let sent = daemon.wait_for_event(common::ATTEMPTED, "of the cleanup, sent", |e| {
        e["action"] == "cleanup" && e["outcome"] == "sent"
    });
    delivered(&daemon.process, &http, 1);
    peak_within_bound("cleanup", &daemon.process, idle);
    assert!(
        sent.to_string()
            .contains("deleted 0 key(s) and 1 hash field(s)"),
        "{sent}"
    );
    let fields: Vec<String> = redis::cmd("HKEYS").arg("online").query(&mut conn).unwrap();
    assert_eq!(fields, ["someone"]);
    daemon.stop();
}

/// A rule on every field of hashes `long:…` (`hexpired`), to the webhook of `http`.
fn field_rules(http: &HttpReceiver) -> String {
    format!(
        r#"
channels:
  hook: {{ type: webhook, url: "{hook}" }}
rules:
  - name: long
    match: "long:{{id}}"
    field: "{{f}}"
    on: [hexpired]
    notify: {{ to: [hook] }}
"#,
        hook = http.url_for("/hook")
    )
}

/// A Valkey (hash-field expiry) with the flags `hexpired` rules need, whose subscribers may fall
/// 64 MB behind (as [`long_key_server`]).
fn field_server() -> common::RedisServerBuilder {
    common::RedisServer::builder()
        .binary(common::tools::valkey_server_bin())
        .notify_keyspace_events("Exgh")
        .config("client-output-buffer-limit", "pubsub 256mb 64mb 60")
}

/// A hash of a 16 MB name with twenty fields that expire together (`hexpired`, Valkey): each
/// field alerted once, keywatch within the bound, the field ledger keeps the name once in Redis
/// (not once per field, in every member and in the index's name), and nothing of it is left
/// once every field is taken.
#[test]
fn a_16_mb_hash_s_expiring_fields_stay_within_the_bound() {
    let http = services();
    let yaml = field_rules(&http);
    let redis = field_server().start();
    let daemon = Daemon::launch(redis, Rules::new(&yaml), Logs::Json, &[]);
    let idle = idle_rss(&daemon.process);
    let mut conn = daemon.conn();
    let used = |conn: &mut redis::Connection| -> f64 {
        let info: String = redis::cmd("INFO").arg("memory").query(conn).unwrap();
        let n: f64 = info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        n / (1 << 20) as f64
    };
    let key = format!("long:{}", "k".repeat(16 << 20));
    let fields: Vec<String> = (0..20).map(|i| format!("f{i}")).collect();
    let mut pipe = redis::pipe();
    for f in &fields {
        pipe.cmd("HSET").arg(&key).arg(f).arg("v").ignore();
    }
    let () = pipe.query(&mut conn).unwrap();
    let before = used(&mut conn);
    let _: Vec<i64> = redis::cmd("HPEXPIRE")
        .arg(&key)
        .arg(3000)
        .arg("FIELDS")
        .arg(fields.len())
        .arg(&fields)
        .query(&mut conn)
        .unwrap();
    common::wait_until("the field ledger learnt every field", PATIENCE, || {
        common::ledger::fields(&mut conn, "keywatch:").len() == fields.len()
    });
    let learnt = used(&mut conn);
    println!("redis used_memory: {before:.1} MiB before, {learnt:.1} once learnt");
    let names = NameMessages::start(&daemon.redis.url());
    each_field_alerted_once(&daemon.process, &http, &fields);
    wait_until_gone(&mut conn, &key);
    // The server's `hexpired` comes once per expiry cycle: a busy server takes the twenty
    // fields in several, each message naming the hash whole, which keywatch reads at once (CI
    // saw 383 MiB above idle before they shared one copy; the drill below makes it certain).
    println!("the server sent {} messages naming the hash", names.stop());
    peak_within_bound("hash fields", &daemon.process, idle);
    // The hash's name once (16 MiB), not once per field and again in its index's name.
    assert!(
        learnt - before < 20.0,
        "{:.1} MiB more in Redis",
        learnt - before
    );
    common::wait_until("the field ledger let go of the hash", PATIENCE, || {
        let left: Vec<Vec<u8>> = redis::cmd("KEYS")
            .arg("keywatch:fields:0:*")
            .query(&mut conn)
            .unwrap();
        left.iter().all(|k| k.ends_with(b":minutes"))
    });
    daemon.stop();
}

/// A hash of a 16 MB name whose fields expire one after the other while keywatch is stopped
/// (`SIGSTOP`): the server publishes a `hexpired` per expiry cycle, each naming the hash whole,
/// and they wait for keywatch together; redis-rs reads them all at once when it resumes. Each
/// field is alerted once, and keywatch stays within the bound: what names the same long key
/// shares one copy (before, 233–262 MiB above idle).
#[test]
fn a_16_mb_hash_s_fields_expiring_one_by_one_while_keywatch_is_stopped_stay_within_the_bound() {
    const FIELDS: usize = 12;
    let http = services();
    let redis = field_server().start();
    let mut daemon = Daemon::launch(redis, Rules::new(&field_rules(&http)), Logs::Json, &[]);
    let idle = idle_rss(&daemon.process);
    let mut conn = daemon.conn();
    let key = format!("long:{}", "k".repeat(16 << 20));
    let fields: Vec<String> = (0..FIELDS).map(|i| format!("f{i}")).collect();
    let mut pipe = redis::pipe();
    for f in &fields {
        pipe.cmd("HSET").arg(&key).arg(f).arg("v").ignore();
    }
    // A fifth of a second apart: each in an expiry cycle of its own (ten a second).
    for (i, f) in fields.iter().enumerate() {
        pipe.cmd("HPEXPIRE")
            .arg(&key)
            .arg(5000 + 200 * i)
            .arg("FIELDS")
            .arg(1)
            .arg(f)
            .ignore();
    }
    let () = pipe.query(&mut conn).unwrap();
    common::wait_until("the field ledger learnt every field", PATIENCE, || {
        common::ledger::fields(&mut conn, "keywatch:").len() == FIELDS
    });
    let names = NameMessages::start(&daemon.redis.url());
    daemon.process.signal(common::Signal::STOP);
    wait_until_gone(&mut conn, &key);
    let sent = names.stop();
    // The drill is what it says: several messages of 16 MiB waited for keywatch together.
    assert!(sent >= 4, "the server sent {sent} messages naming the hash");
    daemon.process.signal(common::Signal::CONT);
    each_field_alerted_once(&daemon.process, &http, &fields);
    println!("the server sent {sent} messages naming the hash while keywatch was stopped");
    peak_within_bound("fields one by one, stopped", &daemon.process, idle);
    daemon.stop();
}

/// Waits for one request per field of `fields` and fails unless each names one of them once.
fn each_field_alerted_once(process: &KeywatchProcess, http: &HttpReceiver, fields: &[String]) {
    let requests = delivered(process, http, fields.len());
    let mut alerted: Vec<String> = requests
        .iter()
        .map(|r| r.json()["field"].as_str().unwrap_or_default().to_string())
        .collect();
    alerted.sort();
    let mut want = fields.to_vec();
    want.sort();
    assert_eq!(alerted, want, "each field alerted once");
}

/// Waits until `key` no longer exists (a hash: its last field expired).
fn wait_until_gone(conn: &mut redis::Connection, key: &str) {
    common::wait_until("the hash is gone", PATIENCE, || {
        !redis::cmd("EXISTS").arg(key).query::<bool>(conn).unwrap()
    });
}

/// Counts the messages of database 0's keyevent channels that name a long key whole, as a
/// subscriber of the test's own reads them, from [`NameMessages::start`] until
/// [`NameMessages::stop`].
struct NameMessages {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    counted: std::thread::JoinHandle<usize>,
}

impl NameMessages {
    /// Subscribed when it returns.
    fn start(url: &str) -> NameMessages {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (subscribed, ready) = std::sync::mpsc::channel();
        let client = redis::Client::open(url).unwrap();
        let counted = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut conn = client.get_connection().unwrap();
                conn.set_read_timeout(Some(std::time::Duration::from_secs(1)))
                    .unwrap();
                let mut sub = conn.as_pubsub();
                sub.psubscribe("__keyevent@0__:*").unwrap();
                subscribed.send(()).unwrap();
                let mut n = 0;
                loop {
                    match sub.get_message() {
                        Ok(m) if m.get_payload_bytes().len() > 64 * 1024 => n += 1,
                        Ok(_) => {}
                        // Nothing more waits: what was published before `stop` is read.
                        Err(e) if e.is_timeout() => {
                            if stop.load(std::sync::atomic::Ordering::SeqCst) {
                                return n;
                            }
                        }
                        Err(e) => panic!("the test's subscriber: {e}"),
                    }
                }
            }
        });
        ready.recv().unwrap();
        NameMessages { stop, counted }
    }

    /// How many were read; every message published before the call is read first (the count
    /// ends at a second with nothing to read).
    fn stop(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.counted.join().unwrap()
    }
}

/// Upgrading from a keywatch whose field ledger named a long hash by its bytes (in every member
/// and in its index's name): the new instance moves it to its SHA-256 when the fields come due,
/// so that a field gone while no instance ran is recovered and one still to come fires on time,
/// each once, and nothing of the old naming is left.
#[test]
fn a_long_hash_an_earlier_keywatch_named_by_its_bytes_is_moved_without_losing_a_field() {
    let http = services();
    let yaml = field_rules(&http);
    let redis = field_server().start();
    let mut conn = redis.conn();
    let (s, us): (i64, i64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let now = s * 1000 + us / 1000;
    let key = format!("long:{}", "k".repeat(70_000));
    let mut old = redis::pipe();
    for (field, deadline) in [("gone", now - 2_000), ("soon", now + 3_000)] {
        let second = deadline / 1000;
        old.cmd("HSET")
            .arg(format!("keywatch:fields:0:at:{second}:long"))
            .arg(format!("{}:{key}{field}", key.len()))
            .arg(deadline - second * 1000)
            .ignore();
        old.cmd("ZADD")
            .arg("keywatch:fields:0:minutes")
            .arg("LT")
            .arg(deadline)
            .arg(second / 60)
            .ignore();
        old.cmd("HSET")
            .arg(format!("keywatch:fields:0:h:{key}"))
            .arg(field)
            .arg(deadline)
            .ignore();
    }
    old.cmd("HSET").arg(&key).arg("soon").arg("v").ignore();
    old.cmd("HPEXPIREAT")
        .arg(&key)
        .arg(now + 3_000)
        .arg("FIELDS")
        .arg(1)
        .arg("soon")
        .ignore();
    let () = old.query(&mut conn).unwrap();
    let daemon = Daemon::launch(redis, Rules::new(&yaml), Logs::Json, &[]);
    let requests = delivered(&daemon.process, &http, 2);
    common::wait_no_work_left(&mut conn);
    let mut alerted: Vec<(String, bool)> = http
        .requests()
        .iter()
        .map(|r| {
            let j = r.json();
            (
                j["field"].as_str().unwrap_or_default().to_string(),
                j["recovered"].as_bool().unwrap_or_default(),
            )
        })
        .collect();
    alerted.sort();
    assert_eq!(
        alerted,
        [("gone".to_string(), true), ("soon".to_string(), false)],
        "{} requests",
        requests.len()
    );
    // The minutes' set, and the poker's copies of due long members, which live a minute.
    let left: Vec<Vec<u8>> = redis::cmd("KEYS")
        .arg("keywatch:fields:0:*")
        .query(&mut conn)
        .unwrap();
    let lasting = |k: &Vec<u8>| {
        let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut conn).unwrap();
        !k.ends_with(b":minutes") && ttl < 0
    };
    assert!(
        !left.iter().any(lasting),
        "left: {:?}",
        left.iter()
            .map(|k| String::from_utf8_lossy(&k[..k.len().min(40)]).into_owned())
            .collect::<Vec<_>>()
    );
    daemon.stop();
}
