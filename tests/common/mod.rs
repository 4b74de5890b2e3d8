//! The integration-test harness: real servers, real receivers, the real binary.
//!
//! Every test binary includes this tree with `mod common;` and uses a subset of it, hence the
//! `dead_code` and `unused_imports` (for the re-exports below) allowances.
//!
//! # Layout
//!
//! - [`ports`]: free loopback ports, never handed out twice within one test process.
//! - [`tools`]: where `redis-server` / `redis-cli` are (`KEYWATCH_REDIS_SERVER`,
//!   `KEYWATCH_REDIS_CLI`, or `PATH`); a missing server fails the test with the fix, never skips it.
//! - [`redis_server`]: one throwaway `redis-server` child per test ([`RedisServer`]).
//! - [`redis_cluster`]: a Redis Cluster of such children, formed by hand ([`RedisCluster`]).
//! - [`http_receiver`]: a real HTTP/1.1 server on std threads that records exact bytes and plays
//!   scripted responses ([`HttpReceiver`]).
//! - [`keywatch`]: running the real `keywatch` binary ([`Keywatch`], [`run_keywatch`]).
//! - [`rules`]: writing rule files into temp dirs ([`write_rules`]).
//! - [`tls`]: a test CA with server and client certificates, made in the test ([`TestPki`]), for
//!   servers started with [`RedisServerBuilder::tls`].
#![allow(dead_code, unused_imports)]

pub mod http_receiver;
pub mod keywatch;
pub mod ports;
pub mod redis_cluster;
pub mod redis_server;
pub mod rules;
pub mod tls;
pub mod tools;
mod wait;

pub use http_receiver::{HttpReceiver, Request, Response};
pub use keywatch::{Keywatch, KeywatchProcess, keywatch_bin, keywatch_command, run_keywatch};
pub use redis_cluster::{ClusterNode, RedisCluster, RedisClusterBuilder};
pub use redis_server::{ClientCert, RedisServer, RedisServerBuilder};
pub use rules::write_rules;
/// For [`KeywatchProcess::signal`], e.g. `Signal::HUP`.
pub use rustix::process::Signal;
pub use tls::TestPki;
pub use wait::wait_until;
