//! The integration-test harness: real servers, real receivers, the real binary.
//!
//! Every test binary includes this tree with `mod common;` and uses a subset of it, hence the
//! `dead_code` and `unused_imports` (for the re-exports below) allowances.
//!
//! # Layout
//!
//! - [`ports`]: free loopback ports, never handed out twice within one test process.
//! - [`tools`]: where `redis-server` is (`KEYWATCH_REDIS_SERVER`
//!   or `PATH`); a missing server fails the test with the fix, never skips it.
//! - [`redis_server`]: one throwaway `redis-server` child per test ([`RedisServer`]).
//! - [`redis_cluster`]: a Redis Cluster of such children, formed by hand ([`RedisCluster`]).
//! - [`redis_sentinel`]: a master, a replica and three sentinels of such children
//!   ([`RedisSentinels`]), for failovers.
//! - [`commands`]: Redis commands tests repeat: keys with a TTL, keys that expire right now
//!   ([`expire_now`]), the notification flags, what keywatch still has to do ([`work_left`]).
//! - [`http_receiver`]: a real HTTP/1.1 server on std threads that records exact bytes and plays
//!   scripted responses ([`HttpReceiver`]).
//! - [`daemon`]: running the real `keywatch` binary: one-shot commands ([`run_keywatch`]), the
//!   daemon as a child ([`KeywatchProcess`], [`run_on`]), on its own Redis ([`Daemon`]) and with
//!   a receiver ([`Rig`]).
//! - [`endpoint`]: the daemon's HTTP endpoint: its address, GET/POST, metric sums.
//! - [`rules`]: rule files in temp dirs ([`write_rules`], [`Rules`], [`lock_rules`]) and configs.
//! - [`smtp_server`]: a real SMTP server (Python's aiosmtpd) with STARTTLS or TLS, AUTH and
//!   scripted answers, and the mails it accepted ([`SmtpServer`], [`Mail`]).
//! - [`tls`]: a test CA with server and client certificates, made in the test ([`TestPki`]), for
//!   servers started with [`RedisServerBuilder::tls`].
//! - [`wait`]: [`PATIENCE`], the upper bound of every wait, and polling ([`wait_until`]).
//! - [`alertmanager`]: a real Prometheus Alertmanager per test, routing to an [`HttpReceiver`]
//!   ([`alertmanager::Alertmanager`]).
//! - [`forged`]: keywatch's state written by hand, as an application that can write
//!   `keywatch:*` could ([`forge_job`]); the one place that knows the queue's stored form.
#![allow(dead_code, unused_imports)]

pub mod alertmanager;
pub mod commands;
pub mod daemon;
pub mod endpoint;
pub mod forged;
pub mod http_receiver;
pub mod ledger;
pub mod ports;
pub mod redis_cluster;
pub mod redis_sentinel;
pub mod redis_server;
pub mod rules;
pub mod smtp_server;
pub mod tls;
pub mod tools;
pub mod wait;

pub use commands::{
    expire_now, jobs_in, notify_flags, set_and_expire_now, set_px, set_with_ttl, touch_until_gone,
    wait_no_work_left, work_left,
};
pub use daemon::{
    ATTEMPTED, DEAD_LETTERED, Daemon, KeywatchProcess, Logs, Rig, SUBSCRIBED, assert_no_secret,
    field_is, field_u64, history_json, keywatch_bin, keywatch_command, run_keywatch, run_on,
    run_subscribed, spawn_keywatch, spawn_run,
};
pub use endpoint::{endpoint, get, metric, post, wait_for_endpoint};
pub use forged::forge_job;
pub use http_receiver::{HttpReceiver, Request, Response, delivered};
pub use redis_cluster::{ClusterNode, RedisCluster, RedisClusterBuilder};
pub use redis_sentinel::RedisSentinels;
pub use redis_server::{ClientCert, RedisServer, RedisServerBuilder};
pub use rules::{
    Rules, documented_acl_lines, hook_rules, lock_rules, log_rule_config, write_rules,
};
/// For [`KeywatchProcess::signal`], e.g. `Signal::HUP`.
pub use rustix::process::Signal;
pub use smtp_server::{Mail, SmtpServer};
pub use tls::TestPki;
pub use wait::{PATIENCE, poll, wait_until};
