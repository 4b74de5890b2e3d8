//! Hostile key text and hostile answers, end to end: the real binary on a real `redis-server`,
//! keys written by an attacker, and local HTTP receivers that check the exact bytes that arrive
//! (the raw request path, the body's size) or answer like a hostile service (echoing a
//! credential, redirecting elsewhere).
//!
//! Each test has its own Redis, receivers and daemon, so the tests run in parallel.

use crate::common;

use common::daemon::Logs;
use common::{
    Daemon, HttpReceiver, PATIENCE, RedisServer, Response, Rules, field_is, run_keywatch,
};
use serde_json::Value;

/// `keywatch ARGS -r RULES` (and `--redis` when given): exit code and stdout + stderr.
fn cli(rules: &Rules, redis: Option<&RedisServer>, args: &[&str]) -> (i32, String, String) {
    let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    all.extend(["-r".into(), rules.arg()]);
    if let Some(r) = redis {
        all.extend(["--redis".into(), r.url()]);
    }
    let out = run_keywatch(all, &[]);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `attempted` event on `key` that ended with `outcome`.
fn attempt_on(daemon: &Daemon, key: &str, outcome: &str) -> Value {
    daemon.wait_for_event(
        common::ATTEMPTED,
        &format!("with outcome {outcome} for {key:?}"),
        |e| field_is(e, "key", key) && field_is(e, "outcome", outcome),
    )
}

// ---------------------------------------------------------------------------------------------
// A capture in a reload URL's path

const RELOAD_RULES: &str = r#"
rules:
  - name: cache-reload
    match: "cache:{user_id}:{kind}"
    reload: { url: "@RECEIVER@/reload/{{ kind }}/{{ user_id }}" }
"#;

/// docs/rules.md: key text never widens an action. `cache:flushall:..` made keywatch POST to
/// `/flushall`: a capture that would make a whole path segment `.` or `..` is refused (the URL
/// standard resolves dot segments however they are spelled, `%2E%2E` included, so no spelling
/// reaches the receiver as written), and every other capture arrives percent-encoded inside
/// its own segment, as the receiver reads the raw request line.
#[test]
fn a_capture_cannot_climb_out_of_a_reload_path() {
    let receiver = HttpReceiver::start();
    let redis = RedisServer::with_events("Exg");
    let rules = Rules::new(&RELOAD_RULES.replace("@RECEIVER@", &receiver.url()));
    let daemon = Daemon::launch(redis, rules, Logs::Json, &[]);

    let hostile = [
        "cache:flushall:..",
        "cache:..:..",
        "cache:x:.",
        "cache:..:%2E",
    ];
    let fine = [
        ("cache:a/b:x", "/reload/x/a%2Fb"),
        ("cache:u1:...", "/reload/.../u1"),
        ("cache:%2e%2e:k", "/reload/k/%252e%252e"),
        ("cache:..\\x:k", "/reload/k/..%5Cx"),
        ("cache:u7:ok", "/reload/ok/u7"),
    ];
    let mut keys: Vec<&str> = hostile.to_vec();
    keys.extend(fine.iter().map(|(k, _)| *k));
    daemon.expire_all(&keys);

    for key in hostile {
        let line = attempt_on(&daemon, key, "failed");
        let reason = line["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains("segment") && reason.contains("not sent"),
            "{key}: {line}"
        );
    }
    let requests = receiver.wait_for(fine.len(), PATIENCE);
    let mut paths: Vec<String> = requests.iter().map(|r| r.target.clone()).collect();
    paths.sort();
    let mut want: Vec<String> = fine.iter().map(|(_, p)| p.to_string()).collect();
    want.sort();
    assert_eq!(paths, want, "the raw paths the receiver saw");

    // `explain` shows the URL exactly as it is requested, or says it is never sent.
    let (code, out, err) = cli(&daemon.rules, None, &["explain", "cache:a/b:x"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&format!("{}/reload/x/a%2Fb", receiver.url())),
        "{out}"
    );
    let (code, out, err) = cli(&daemon.rules, None, &["explain", "cache:flushall:.."]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("never sent"), "{out}");
    assert!(!out.contains("/reload/../flushall"), "{out}");
    daemon.stop();
}

// ---------------------------------------------------------------------------------------------
// Secrets in answers, and redirects

/// The `GET /api/history` body of `daemon`'s endpoint.
fn api_history(daemon: &Daemon) -> String {
    let (status, body) = common::get(&common::endpoint(&daemon.process), "/api/history");
    assert_eq!(status, 200, "{body}");
    body
}

/// An answer that echoes a credential is masked before it is cut: a token straddling the
/// 300-byte edge left its first bytes in the log, history, `/api/history` and `dead list`; a
/// 400 echoing `Authorization: Basic …` showed the base64 of the URL's `user:password`.
#[test]
fn a_secret_echoed_in_an_answer_never_shows_even_cut() {
    use base64::Engine;
    let token = "tk9Zq-Secret-0123456789abcdef";
    let password = "pa55-W0rd-xyz\"q";
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("svc-user:{password}"));
    let hook = HttpReceiver::with_default(
        // 294 bytes, then the token across byte 300 of the answer.
        Response::status(400).body(format!("{} token={token} rest", "e".repeat(287))),
    );
    let basic_hook = HttpReceiver::start();
    basic_hook.set_handler(|r| {
        let auth = r.header("authorization").unwrap_or("none").to_string();
        Some(Response::status(401).body(format!(
            "{{\"error\":\"bad credentials\",\"got\":\"{auth}\",\"url\":\"{}\"}}",
            r.target
        )))
    });
    let yaml = format!(
        r#"
channels:
  hook:
    type: webhook
    url: "{}/hook?token=${{HOOK_TOKEN}}"
  basic:
    type: webhook
    url: "http://svc-user:{}@127.0.0.1:{}/basic"
rules:
  - name: echo
    match: "echo:{{id}}"
    notify: {{ to: [hook, basic] }}
"#,
        hook.url(),
        password.replace('"', "%22"),
        basic_hook.port()
    );
    let redis = RedisServer::with_events("Exg");
    let daemon = Daemon::launch(
        redis,
        Rules::new(&yaml),
        Logs::Json,
        &[("HOOK_TOKEN", token)],
    );
    daemon.expire("echo:1");
    for channel in ["hook", "basic"] {
        daemon.dead_letter_on(channel);
    }
    let sent = format!("Basic {basic}");
    assert!(
        basic_hook.requests()[0].header("authorization") == Some(sent.as_str()),
        "the receiver got the credentials: {}",
        basic_hook.requests()[0].summary()
    );
    let (code, dead, err) = cli(&daemon.rules, Some(&daemon.redis), &["dead", "list"]);
    assert_eq!(code, 0, "{dead}{err}");
    let (_, dead_json, _) = cli(
        &daemon.rules,
        Some(&daemon.redis),
        &["dead", "list", "--json"],
    );
    let (_, history, _) = cli(&daemon.rules, Some(&daemon.redis), &["history"]);
    let leaks = [
        &token[..6],
        token,
        password,
        "pa55-W0rd",
        basic.as_str(),
        &basic[..12],
    ];
    for (what, text) in [
        ("the log", daemon.stderr()),
        ("dead list", dead),
        ("dead list --json", dead_json),
        ("history", history),
        ("/api/history", api_history(&daemon)),
    ] {
        common::assert_no_secret(what, &text, &leaks);
    }
    daemon.stop();
}

/// A 307 to another origin carried `X-Token` and the `?token=` query to it: a redirect is
/// followed only within the origin the rules named; elsewhere it fails for good, saying where
/// it pointed (its origin only).
#[test]
fn a_redirect_to_another_origin_is_not_followed() {
    let token = "tok-0123456789-redirect";
    let elsewhere = HttpReceiver::start();
    let hook = HttpReceiver::with_default(Response::status(307).header(
        "Location",
        &elsewhere.url_for(&format!("/steal?token={token}")),
    ));
    let same = HttpReceiver::start();
    same.set_handler(|r| {
        Some(match r.path() {
            "/start" => Response::status(307).header("Location", "/final?token=kept"),
            _ => Response::ok_body("ok"),
        })
    });
    let yaml = format!(
        r#"
channels:
  away:
    type: webhook
    url: "{}/hook?token=${{HOOK_TOKEN}}"
    headers: {{ X-Token: "${{HOOK_TOKEN}}" }}
  near:
    type: webhook
    url: "{}/start"
    headers: {{ X-Token: "${{HOOK_TOKEN}}" }}
rules:
  - name: moved
    match: "moved:{{id}}"
    notify: {{ to: [away, near] }}
"#,
        hook.url(),
        same.url()
    );
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        Rules::new(&yaml),
        Logs::Json,
        &[("HOOK_TOKEN", token)],
    );
    daemon.expire("moved:1");
    let failed = daemon.attempt_on("away", "failed");
    let reason = failed["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("redirect"), "{failed}");
    assert!(reason.contains(&elsewhere.url()), "{failed}");
    daemon.attempt_on("near", "sent");
    assert_eq!(
        elsewhere.count(),
        0,
        "the other origin got {:#?}",
        elsewhere
            .requests()
            .iter()
            .map(|r| r.summary())
            .collect::<Vec<_>>()
    );
    let got = same.requests();
    let last = got.last().unwrap();
    assert_eq!(last.target, "/final?token=kept", "{}", last.summary());
    assert_eq!(last.header("x-token"), Some(token));
    common::assert_no_secret("the log", &daemon.stderr(), &[token]);
    daemon.stop();
}

// ---------------------------------------------------------------------------------------------
// Message size

/// A key of `len` bytes after `prefix` that every escaping makes longer: Markdown
/// metacharacters, mentions, quotes and backslashes (JSON doubles them), a line break.
fn swollen_key(prefix: &str, len: usize) -> String {
    let unit = "a*_[@\"\\\n<";
    let mut k = String::from(prefix);
    while k.len() < len {
        k.push_str(unit);
    }
    k
}

/// A 1 MB key made a 4.19 MB DingTalk markdown title and Feishu card header (only the message
/// text was cut), which DingTalk refuses (460101, not retried: the alert was lost), and a
/// 14.7 MB Alertmanager-format body. Every part of every message is bounded now, the cut
/// marked, and each alert is sent.
#[test]
fn a_one_megabyte_key_still_fits_every_chat_message() {
    let robot = |limit: usize, refusal: serde_json::Value| {
        let r = HttpReceiver::start();
        r.set_handler(move |req| {
            Some(if req.body.len() > limit {
                Response::json(&refusal)
            } else {
                Response::json(&serde_json::json!({"errcode": 0, "errmsg": "ok", "code": 0}))
            })
        });
        r
    };
    let refused_ding =
        serde_json::json!({"errcode": 460101, "errmsg": "message too long, exceed 20000 bytes"});
    let ding = robot(20_000, refused_ding.clone());
    let ding_text = robot(20_000, refused_ding);
    let feishu = robot(
        20_000,
        serde_json::json!({"code": 19036, "msg": "The message exceeds the size limit"}),
    );
    let wecom = HttpReceiver::start();
    wecom.set_handler(|req| {
        let j: Value = serde_json::from_slice(&req.body).unwrap_or_default();
        let len = j["markdown"]["content"].as_str().map_or(0, str::len);
        Some(Response::json(&if len > 4096 {
            serde_json::json!({"errcode": 40058, "errmsg": "markdown.content exceed max length 4096"})
        } else {
            serde_json::json!({"errcode": 0, "errmsg": "ok"})
        }))
    });
    let slack = HttpReceiver::with_default(Response::ok_body("ok"));
    let am = HttpReceiver::start();
    let yaml = format!(
        r#"
channels:
  ding: {{ type: dingtalk, url: "{}/robot/send?access_token=x", rate: 100/s }}
  ding_text: {{ type: dingtalk, url: "{}/robot/send?access_token=x", msgtype: text, rate: 100/s }}
  feishu: {{ type: feishu, url: "{}/hook", msgtype: markdown, rate: 100/s }}
  wecom: {{ type: wecom, url: "{}/send?key=x", msgtype: markdown, rate: 100/s }}
  slack: {{ type: slack, url: "{}/services/x", rate: 100/s }}
  am: {{ type: webhook, url: "{}/alerts", format: alertmanager }}
rules:
  - name: big
    match: "big:{{id}}"
    notify:
      to: [ding]
      title: "expired: {{{{ key }}}}"
      message: "{{{{ key }}}} expired ({{{{ id }}}})"
  - name: wide
    match: "wide:{{id}}"
    notify:
      to: [ding_text, feishu, wecom, slack, am]
      title: "expired: {{{{ key }}}}"
      message: "{{{{ key }}}} expired ({{{{ id }}}})"
"#,
        ding.url(),
        ding_text.url(),
        feishu.url(),
        wecom.url(),
        slack.url(),
        am.url(),
    );
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        Rules::new(&yaml),
        Logs::Json,
        &[],
    );
    // The 1 MB key to DingTalk; a 64 KiB one, still over every limit, to the other channels (a
    // debug build spends seconds composing each message of a 1 MB key).
    daemon.expire(swollen_key("big:", 1 << 20));
    daemon.expire(swollen_key("wide:", 64 << 10));
    // A debug build takes seconds per message of a 1 MB key (rendering, escaping, the log
    // line), and a busy machine may time a request out meanwhile: each channel is waited for
    // until it is sent (a retry is fine), six times the usual patience.
    for channel in ["ding", "ding_text", "feishu", "wecom", "slack", "am"] {
        let attempts = || daemon.events(common::ATTEMPTED).into_iter();
        let outcomes = || {
            attempts()
                .filter(|e| field_is(e, "channel", channel))
                .map(|e| format!("{} {}", e["outcome"], e["reason"]))
                .collect::<Vec<_>>()
        };
        common::poll(
            &format!("the alert sent on {channel}"),
            PATIENCE * 6,
            || {
                attempts()
                    .find(|e| field_is(e, "channel", channel) && field_is(e, "outcome", "sent"))
            },
            || format!("{channel}: {:?}", outcomes()),
        );
    }
    let one = |r: &HttpReceiver| {
        let got = r.wait_for(1, PATIENCE);
        assert_eq!(
            got.len(),
            1,
            "{:?}",
            got.iter().map(|r| r.summary()).collect::<Vec<_>>()
        );
        got.into_iter().next().unwrap()
    };
    let d = one(&ding);
    assert!(
        d.body.len() <= 20_000,
        "dingtalk markdown body: {} bytes",
        d.body.len()
    );
    let j = d.json();
    let title = j["markdown"]["title"].as_str().unwrap();
    assert!(
        title.starts_with("expired: big:") && title.ends_with('…'),
        "{title:.80}"
    );
    assert!(j["markdown"]["text"].as_str().unwrap().contains('…'));
    let d = one(&ding_text);
    assert!(
        d.body.len() <= 20_000,
        "dingtalk text body: {} bytes",
        d.body.len()
    );
    let f = one(&feishu);
    assert!(
        f.body.len() <= 20_000,
        "feishu card: {} bytes",
        f.body.len()
    );
    let header = f.json()["card"]["header"]["title"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(header.ends_with('…'), "{header:.80}");
    let w = one(&wecom);
    let content = w.json()["markdown"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        content.len() <= 4096,
        "wecom markdown: {} bytes",
        content.len()
    );
    let s = one(&slack);
    let text = s.json()["text"].as_str().unwrap().to_string();
    assert!(
        text.chars().count() <= 40_000,
        "slack: {} chars",
        text.chars().count()
    );
    let a = one(&am);
    assert!(
        a.body.len() <= 20_000,
        "alertmanager body: {} bytes",
        a.body.len()
    );
    // The key's cut view: its first bytes, its length and a short hash
    // (docs/reliability.md#bounded-whatever-the-key).
    let alert = &a.json()["alerts"][0];
    let label = alert["labels"]["redis_key"].as_str().unwrap();
    assert!(label.len() <= 1024, "{}", label.len());
    assert!(label.contains(" bytes, sha256 "), "{label}");
    daemon.stop();
}

// ---------------------------------------------------------------------------------------------
// Control and bidi characters shown to people

/// A key holding ESC, BEL, CR/LF and U+202E: printed as-is by `upcoming`, `dead list`,
/// `explain` and the text log, it repainted terminals and forged log lines. Shown escaped now;
/// JSON output keeps the exact text.
#[test]
fn control_and_bidi_characters_in_a_key_are_shown_escaped() {
    let hook = HttpReceiver::with_default(Response::status(400).body("no\x1b[2J\u{202e}"));
    let key = "ctl:\x1b[31mred\x07\r\nFAKE level=ERROR forged\u{202e}txt.exe";
    let yaml = format!(
        r#"
channels:
  hook: {{ type: webhook, url: "{}/hook" }}
rules:
  - name: ctl
    match: "ctl:{{id}}"
    notify: {{ to: [hook] }}
"#,
        hook.url()
    );
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        Rules::new(&yaml),
        Logs::Text,
        &[],
    );
    {
        let mut c = daemon.conn();
        redis::cmd("SET")
            .arg("ctl:\x1b]0;title\x07soon\n")
            .arg("v")
            .arg("EX")
            .arg(600)
            .exec(&mut c)
            .unwrap();
    }
    daemon.expire(key);
    daemon.wait_for_event(common::DEAD_LETTERED, "of the key", |_| true);
    let raw = ['\x1b', '\x07', '\r', '\u{202e}'];
    let assert_escaped = |what: &str, text: &str| {
        for c in raw {
            assert!(!text.contains(c), "{what} shows {c:?} raw:\n{text:?}");
        }
        assert!(
            !text.contains("\nFAKE"),
            "{what} lets the key write a line:\n{text}"
        );
    };
    assert_escaped("the text log", &daemon.stderr());
    assert!(
        daemon.stderr().contains("\\u{1b}[31mred"),
        "{}",
        daemon.stderr()
    );
    let redis = &daemon.redis;
    for args in [
        &["dead", "list"][..],
        &["history"],
        &["upcoming", "--within", "1h"],
        &["explain", key],
    ] {
        let (code, out, err) = cli(
            &daemon.rules,
            Some(redis).filter(|_| args[0] != "explain"),
            args,
        );
        assert_eq!(code, 0, "{args:?}: {out}{err}");
        assert_escaped(&format!("{args:?}"), &out);
        assert!(out.contains("\\u{1b}"), "{args:?}: {out}");
    }
    // JSON output keeps the exact key.
    let (_, out, _) = cli(&daemon.rules, Some(redis), &["dead", "list", "--json"]);
    let letter: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(letter["key"], key);
    daemon.stop();
}

/// The chat robots' bodies (Slack, DingTalk, Feishu, WeCom) show a key's control and bidi
/// characters as `\u202E`, as Teams, Telegram and PagerDuty do: raw, U+202E turns the message
/// around it backwards and ESC carries a terminal escape to whoever reads it in a console.
#[test]
fn chat_robots_show_control_and_bidi_characters_escaped() {
    let robots = HttpReceiver::start();
    robots.set_handler(|r| {
        Some(match r.path() {
            "/slack" => Response::ok_body("ok"),
            "/feishu" => Response::json(&serde_json::json!({"code": 0, "msg": "ok"})),
            _ => Response::json(&serde_json::json!({"errcode": 0, "errmsg": "ok"})),
        })
    });
    let u = |p: &str| robots.url_for(p);
    let yaml = format!(
        r#"
channels:
  slack: {{ type: slack, url: "{}" }}
  ding: {{ type: dingtalk, url: "{}" }}
  ding_text: {{ type: dingtalk, url: "{}", msgtype: text }}
  feishu: {{ type: feishu, url: "{}" }}
  feishu_card: {{ type: feishu, url: "{}", msgtype: markdown }}
  wecom: {{ type: wecom, url: "{}" }}
  wecom_md: {{ type: wecom, url: "{}", msgtype: markdown }}
rules:
  - name: turned
    match: "turned:{{id}}"
    notify:
      to: [slack, ding, ding_text, feishu, feishu_card, wecom, wecom_md]
      title: "Lock {{{{ id }}}}"
      message: "{{{{ key }}}} expired"
"#,
        u("/slack"),
        u("/ding"),
        u("/ding_text"),
        u("/feishu"),
        u("/feishu_card"),
        u("/wecom"),
        u("/wecom_md"),
    );
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        Rules::new(&yaml),
        Logs::Json,
        &[],
    );
    daemon.expire("turned:txt\u{202E}exe.\u{2066}x\u{1b}[2J\u{7}");
    let requests = robots.wait_for(7, PATIENCE);
    for r in &requests {
        let text = r.json().to_string();
        for raw in ['\u{202E}', '\u{2066}', '\u{1b}', '\u{7}'] {
            assert!(!text.contains(raw), "{}: {raw:?} raw in {text}", r.path());
        }
        for shown in ["\\\\u202E", "\\\\u2066", "\\\\u001B", "\\\\u0007"] {
            assert!(text.contains(shown), "{}: no {shown} in {text}", r.path());
        }
    }
    daemon.stop();
}

/// Issue 43: a secret echoed in a spelling of its own was shown. A target that echoes the request
/// line shows the path of its URL (Slack's `/services/T/B/TOKEN`, Feishu's `/hook/TOKEN`), a Go
/// server writes `&`, `<`, `>` of a header it echoes as `\u0026`…, a proxy's error page
/// HTML-escapes it (`&amp;`), a form echoes it percent-encoded: each is masked in the log, `dead
/// list`, `history`, `/api/history`, the status page and `send-test`.
#[test]
fn a_secret_echoed_in_any_spelling_is_masked_wherever_it_shows() {
    let path_token = "xoxbPATHtoken0123456789";
    let header = "h&dr<S3cr3t>value\"0123";
    let hooks = HttpReceiver::start();
    hooks.set_handler(|r| {
        let auth = r.header("x-auth").unwrap_or("").to_string();
        let go = auth
            .replace('&', "\\u0026")
            .replace('<', "\\u003c")
            .replace('>', "\\u003e")
            .replace('"', "\\\"");
        let html = auth
            .replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&quot;");
        let form: String = url::form_urlencoded::byte_serialize(auth.as_bytes()).collect();
        Some(match r.path() {
            p if p.starts_with("/services/") => {
                Response::status(404).body(format!("no_service: POST {} HTTP/1.1", r.target))
            }
            "/go" => {
                Response::status(400).body(format!("{{\"error\":\"bad auth\",\"got\":\"{go}\"}}"))
            }
            "/proxy" => Response::status(403).body(format!("<p>upstream refused {html}</p>")),
            _ => Response::status(400).body(format!("bad x-auth={form}")),
        })
    });
    let yaml = format!(
        r#"
channels:
  slack: {{ type: slack, url: "{slack}" }}
  go: {{ type: webhook, url: "{go}", headers: {{ X-Auth: "${{HDR}}" }} }}
  proxy: {{ type: webhook, url: "{proxy}", headers: {{ X-Auth: "${{HDR}}" }} }}
  form: {{ type: webhook, url: "{form}", headers: {{ X-Auth: "${{HDR}}" }} }}
rules:
  - name: echo
    match: "echo:{{id}}"
    notify: {{ to: [slack, go, proxy, form] }}
"#,
        slack = hooks.url_for(&format!("/services/T0AB12CD3/B0EF45GH6/{path_token}")),
        go = hooks.url_for("/go"),
        proxy = hooks.url_for("/proxy"),
        form = hooks.url_for("/form"),
    );
    let envs = [("HDR", header)];
    let daemon = Daemon::launch(
        RedisServer::with_events("Exg"),
        Rules::new(&yaml),
        Logs::Json,
        &envs,
    );
    daemon.expire("echo:1");
    for channel in ["slack", "go", "proxy", "form"] {
        daemon.dead_letter_on(channel);
    }
    // The targets did echo what is masked.
    let echoed: String = hooks.requests().iter().map(|r| r.target.clone()).collect();
    assert!(echoed.contains(path_token), "{echoed}");
    let run = |args: &[&str]| {
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend(["-r".into(), daemon.rules.arg()]);
        if args[0] != "send-test" {
            all.extend(["--redis".into(), daemon.redis.url()]);
        }
        let out = common::run_keywatch(all, &envs);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let addr = common::endpoint(&daemon.process);
    let mut shown = vec![
        ("the log", daemon.stderr()),
        ("dead list", run(&["dead", "list"])),
        ("dead list --json", run(&["dead", "list", "--json"])),
        ("history", run(&["history"])),
        ("history --json", run(&["history", "--json"])),
        ("/api/history", api_history(&daemon)),
        ("the status page", common::get(&addr, "/").1),
    ];
    for channel in ["slack", "go", "proxy", "form"] {
        shown.push(("send-test", run(&["send-test", channel])));
    }
    let leaks = [
        path_token,
        &path_token[..10],
        "S3cr3t",
        "r\\u003cS3",
        "r&lt;S3",
        "r%3CS3",
    ];
    for (what, text) in &shown {
        common::assert_no_secret(what, text, &leaks);
    }
    daemon.stop();
}
