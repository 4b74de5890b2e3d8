//! What the actions hold for events of long keys (docs/reliability.md#bounded-whatever-the-key):
//! for `--at-once` firings of keys of `--mb` MB, every type of channel's message composed and its
//! request built as an attempt does before sending (Alertmanager's alert, an email, each chat
//! robot's body, with signed links), and the exact key re-matched by the rule's pattern. Nothing
//! is sent. Prints the peak resident memory above what the firings themselves take, and each
//! request's size against its service's limit.
//!
//! `cargo run --release --example long_key [-- --mb 16] [--at-once 1]`
//!
//! It measures the actions alone, in this process: the intake and the queue, which also hold the
//! key, are measured end to end by `tests/e2e/long_keys.rs`.

use std::sync::Arc;

use chrono::Utc;
use keywatch::action::ActionContext;
use keywatch::channel::Dispatch;
use keywatch::config::{self, LiveConfig, Mode};
use keywatch::event::{EventKind, KeyEvent};
use keywatch::firing::Firing;

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const RULES: &str = r#"
links:
  base_url: "https://kw.example"
  secret: "0123456789abcdef0123"
channels:
  ding: { type: dingtalk, url: "http://127.0.0.1:9/ding" }
  slack: { type: slack, url: "http://127.0.0.1:9/services/T/B/X" }
  feishu: { type: feishu, url: "http://127.0.0.1:9/hook", msgtype: markdown }
  wecom: { type: wecom, url: "http://127.0.0.1:9/wecom?key=x", msgtype: markdown }
  hook: { type: webhook, url: "http://127.0.0.1:9/hook" }
  am: { type: alertmanager, urls: ["http://127.0.0.1:9"] }
  teams: { type: teams, url: "http://127.0.0.1:9/teams" }
  tg: { type: telegram, url: "http://127.0.0.1:9", token: "123456:TGtoken-0123456789abcdef", chat_id: -100123 }
  pd: { type: pagerduty, url: "http://127.0.0.1:9/pd", routing_key: "R0UTINGkey0123456789abcdefABCDEF" }
  mail: { type: email, smtp: "smtp://127.0.0.1:9", tls: none, from: "kw <kw@example.com>", to: oncall@example.com }
  log: { type: log }
rules:
  - name: long
    match: "long:{id}"
    notify:
      to: [ding, slack, feishu, wecom, hook, am, teams, tg, pd, mail, log]
      title: "Lock {{ id }} expired"
      message: "{{ key }} expired: order {{ id }} ({{ captures }})."
    escalate: { after: 1h, to: [log] }
"#;

/// Resident memory now (VmRSS), MiB.
fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmRSS:"))?.to_string();
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

#[tokio::main]
async fn main() {
    let mb = arg("--mb", 16);
    let at_once = arg("--at-once", 1);
    let env = |_: &str| None;
    let config = config::load_texts(vec!["r.yaml".into()], &[RULES.into()], Mode::Check, &env)
        .expect("the rules load")
        .config;
    let keyspace = keywatch::keyspace::Keyspace::new(
        keywatch::yaml::Secret::new("redis://127.0.0.1:1"),
        config.redis.clone(),
    )
    .unwrap();
    let a = ActionContext::new(
        LiveConfig::fixed(config),
        keywatch::channel::http::client(),
        keyspace,
    );
    let rule = a.config.rule("long").unwrap().clone();
    let firings: Vec<Arc<Firing>> = (0..at_once)
        .map(|i| {
            let mut key = format!("long:{i}").into_bytes();
            key.resize(mb << 20, b'k');
            let event = KeyEvent {
                kind: EventKind::Expired,
                db: 0,
                key: key.clone().into(),
                field: None,
                observed_at: Utc::now(),
                deadline: None,
                ttl_ms: None,
                recovered: false,
                source: "127.0.0.1:6379".into(),
                place: None,
            };
            let values = rule.captures_in(&event.key, None).unwrap();
            Arc::new(Firing::new(
                "long",
                &event,
                rule.capture_names(),
                values,
                None,
            ))
        })
        .collect();
    let before = rss_mib();
    keywatch::proc_stats::reset_peak();
    let mut sizes = Vec::new();
    let tasks: Vec<_> = firings
        .iter()
        .map(|f| {
            let a = a.clone();
            let f = f.clone();
            let rule = rule.clone();
            tokio::spawn(async move {
                let mut sizes = Vec::new();
                // What an attempt does first: the key re-matched by the rule's pattern.
                assert!(keywatch::action::refused(&rule, &f).is_none());
                for name in &rule.notify.as_ref().unwrap().to {
                    let ch = a.config.channel(name).unwrap();
                    let size = match ch.integration.alertmanager() {
                        Some(am) => {
                            let alert =
                                keywatch::action::alert::compose(&a, &f, &rule, ch, am, Utc::now())
                                    .unwrap();
                            am.request(0, &alert).map_or(0, |r| r.body.len())
                        }
                        None => {
                            let msg = keywatch::action::notify::compose(&a, &f, &rule, ch).unwrap();
                            match ch.integration.dispatch(ch, &msg, Utc::now()) {
                                Dispatch::Request(r) => r.body.len(),
                                Dispatch::Exchange(_) => msg.text.len(),
                                Dispatch::Done(_) => msg.text.len(),
                            }
                        }
                    };
                    sizes.push((name.clone(), size));
                }
                sizes
            })
        })
        .collect();
    for t in tasks {
        sizes = t.await.unwrap();
    }
    let peak = keywatch::proc_stats::own_peak_rss_mb();
    println!(
        "{at_once} firing(s) of a {mb} MiB key: resident {before:.1} MiB with the firings, peak {peak:.1} MiB while composing every channel's request: {:.1} MiB above",
        peak - before
    );
    for (name, size) in sizes {
        println!("  {name:<7} {size:>8} bytes");
    }
}
