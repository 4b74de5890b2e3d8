//! `keywatch demo`: a self-contained tour on a throwaway `redis-server`.
//!
//! Starts its own server on a free loopback port (never the one on 6379), loads a small rule set
//! whose actions write to the log, sets keys that expire within seconds, shows what fires, and
//! stops everything.

use std::path::PathBuf;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::command::run::{self, RunOptions};
use crate::config::{self, Mode};
use crate::local_redis::{LocalRedis, LocalRedisError};

pub const RULES: &str = r#"
redis:
  notifications: enable
channels:
  console:
    type: log
rules:
  - name: order-lock-timeout
    match: "order_lock:{order_id}"
    notify:
      to: [console]
      title: "Order lock expired"
      message: "Lock of order {{ order_id }} expired before it was released ({{ late_ms }} ms after its deadline)."
  - name: session-cleanup
    match: "session:{sid}"
    cleanup:
      delete: ["session:{{ sid }}:*"]
      hdel: [{ key: "online_users", field: "{{ sid }}" }]
    notify:
      to: [console]
      message: "Session {{ sid }} expired: its keys and its online entry were removed."
  - name: close-unpaid-order
    match: "delay:task:{id}"
    detail: { hash: "delay:detail", field: "{{ id }}", remove: true }
    notify:
      to: [console]
      title: "Unpaid order closed"
      message: "Order {{ detail.order_id }} of {{ detail.user }} ({{ detail.amount }}) was not paid in time."
"#;

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("keywatch demo needs a redis-server: {0}")]
    Server(#[from] LocalRedisError),
    #[error("{0}")]
    Run(String),
}

/// Runs the tour; returns when every demo key has fired (or after 20 s).
pub async fn run() -> Result<(), DemoError> {
    // Blocking: it may first download a valkey-server (see `local_redis::fetch`).
    let server = tokio::task::spawn_blocking(|| LocalRedis::start(&[]))
        .await
        .map_err(|e| DemoError::Run(e.to_string()))??;
    let url = server.url();
    println!(
        "keywatch demo: started a throwaway {} on 127.0.0.1:{}",
        server.binary().display(),
        server.port()
    );
    println!("rules:{RULES}");
    let env = |_: &str| None;
    let loaded = config::load_texts(
        vec![PathBuf::from("demo.yaml")],
        &[RULES.to_string()],
        Mode::Run,
        &env,
    )
    .map_err(|e| DemoError::Run(format!("the demo rules do not load: {e}")))?;

    let stop = CancellationToken::new();
    let opts = RunOptions {
        redis: Some(url.clone()),
        listen: "127.0.0.1:0".parse().expect("a valid address"),
        stop_after: Some(Duration::from_secs(20)),
        rules: Vec::new(),
        shadow: false,
    };
    let runner = tokio::spawn(run::run(loaded.config, opts, stop.clone()));

    let client = redis::Client::open(url.as_str()).map_err(|e| DemoError::Run(e.to_string()))?;
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| DemoError::Run(e.to_string()))?;
    // Give the subscriber a moment to subscribe before the first key expires.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let setup: redis::RedisResult<()> = redis::pipe()
        .cmd("SET")
        .arg("order_lock:42")
        .arg("worker-7")
        .arg("PX")
        .arg(1500)
        .ignore()
        .cmd("SET")
        .arg("session:abc")
        .arg("u-77")
        .arg("PX")
        .arg(2500)
        .ignore()
        .cmd("SET")
        .arg("session:abc:cart")
        .arg("3 items")
        .ignore()
        .cmd("SET")
        .arg("session:abc:prefs")
        .arg("dark")
        .ignore()
        .cmd("HSET")
        .arg("online_users")
        .arg("abc")
        .arg("1")
        .ignore()
        .cmd("HSET")
        .arg("delay:detail")
        .arg("1001")
        .arg(r#"{"order_id": 1001, "user": "u-77", "amount": "99.00"}"#)
        .ignore()
        .cmd("SET")
        .arg("delay:task:1001")
        .arg("")
        .arg("PX")
        .arg(3500)
        .ignore()
        .exec_async(&mut c)
        .await;
    setup.map_err(|e| DemoError::Run(format!("cannot set the demo keys: {e}")))?;
    println!(
        "set order_lock:42 (expires in 1.5 s), session:abc (2.5 s) with session:abc:cart and session:abc:prefs, delay:task:1001 (3.5 s) with its detail in the hash delay:detail\n"
    );

    // Nobody touches these keys: keywatch's deadline ledger makes Redis expire each at its
    // deadline, where Redis alone may take seconds.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let left: i64 = redis::cmd("EXISTS")
        .arg("session:abc:cart")
        .arg("session:abc:prefs")
        .query_async(&mut c)
        .await
        .unwrap_or(-1);
    let details: i64 = redis::cmd("HLEN")
        .arg("delay:detail")
        .query_async(&mut c)
        .await
        .unwrap_or(-1);
    println!(
        "\nafter the tour: {left} of the 2 session:abc:* keys left, {details} field(s) left in delay:detail"
    );
    stop.cancel();
    let result = runner.await.map_err(|e| DemoError::Run(e.to_string()))?;
    drop(server);
    result.map_err(|e| DemoError::Run(e.to_string()))?;
    println!(
        "keywatch demo: done (the server was stopped). Next: write rules in rules/, check them with `keywatch check`, run `keywatch run`."
    );
    Ok(())
}
