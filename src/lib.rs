//! keywatch watches a Redis (or Valkey) server for keys that expire, are evicted or are about to
//! expire, matches each key against rules kept in YAML files, and runs what the rules say.
//!
//! Data flows one way: sources → matching → delivery → actions. The external contract (CLI,
//! rule language, payloads, guarantees) is `SPEC.md`; this crate is one way to honour it.
//!
//! # Layout
//!
//! - [`cli`]: the command line of SPEC §1 (clap), parsed once into a command enum that dispatches.
//! - [`config`]: rule files → a validated, compiled [`config::Config`]; every problem reported as
//!   `FILE:LINE:COLUMN: message`, all of them in one run.
//! - [`pattern`]: the key pattern language of SPEC §3 on bytes, with captures and SCAN globs.
//! - [`matcher`]: all rules compiled into one matcher that finds every matching rule of a key.
//! - [`template`]: Jinja rendering with per-target escaping, so key text never widens an action.
//! - [`event`]: what happened to which key; the vocabulary every stage shares.
//! - [`job`]: a matched event of one rule ([`job::Firing`]) and the actions it owes.
//! - [`explain`]: `keywatch explain`: what would run for a key, rendered, sending nothing.
//! - [`connect`]: settings → Redis clients (URL precedence, credentials, TLS).
//! - [`keyspace`]: the watched Redis, one node or a cluster, behind one connection type.
//! - [`cluster`]: Redis Cluster masters from `CLUSTER NODES`; state keys on one hash tag.
//! - [`source`]: where events come from (keyspace notifications; `notify-keyspace-events`; the
//!   deadline ledger; the scanner that warns before deadlines; following a cluster's masters).
//! - [`claims`]: one firing per event, however many instances saw it.
//! - [`engine`]: matching and detail reads, in batches, producing firings.
//! - [`dead`]: dead letters kept in Redis, listed, re-driven and dropped.
//! - [`silences`]: rules muted for a while, kept in Redis, obeyed by every instance.
//! - [`delivery`]: runs firings' actions in order, retries with backoff, rate-limits channels.
//! - [`queue`]: the durable job queue in Redis, shared by instances.
//! - [`action`]: reload, exec, cleanup, detail, and one module per chat integration.
//! - [`ratelimit`]: token buckets for channels.
//! - [`backlog`]: a rate-limited channel's waiting line; a backlog the rate cannot serve merges into digests.
//! - [`metrics`]: every metric of SPEC §7, defined once.
//! - [`status`]: readiness, recent firings and their outcomes, dead letters, per-rule counts.
//! - [`status_page`]: the HTML status page at `/`, for on-call engineers on a phone.
//! - [`server`]: the HTTP endpoint of SPEC §6.
//! - [`admin`]: `keywatch silence` and `keywatch dead`, which change state in Redis.
//! - [`app`]: `keywatch run`: wiring and shutdown.
//! - [`reload`]: new rules while running (SIGHUP, `POST /-/reload`, file changes), all or nothing.
//! - [`demo`]: `keywatch demo`, a tour on a throwaway redis-server.
//! - [`local_redis`]: a throwaway `redis-server` child, for the demo and the benchmark tools.
//! - [`server_fetch`]: where no redis-server is installed, the pinned valkey-server from PyPI.
//! - [`proc_stats`]: peak RSS and CPU time from `/proc`, for the benchmark tools.
//! - [`send_test`]: `keywatch send-test`, one test message through one channel.
//! - [`doctor`]: `keywatch doctor`, is Redis ready for keywatch (each problem with its fix).
//! - [`upcoming`]: `keywatch upcoming`, keys that expire soon (ledger, or a paced SCAN).

/// A storm of expiries allocates and frees small buffers on every worker thread (firings,
/// rendered templates, HTTP requests); glibc's allocator spent about a third of a mass expiry's
/// CPU in malloc and free. Declared here, not in `main.rs`, so the examples that run
/// `keywatch run` in-process measure the allocator the binary ships with.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

pub mod action;
pub mod admin;
pub mod app;
pub mod backlog;
pub mod claims;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod connect;
pub mod dead;
pub mod delivery;
pub mod demo;
pub mod doctor;
pub mod engine;
pub mod event;
pub mod explain;
pub mod job;
pub mod keyspace;
pub mod local_redis;
pub mod matcher;
pub mod metrics;
pub mod pattern;
pub mod proc_stats;
pub mod queue;
pub mod ratelimit;
pub mod reload;
pub mod send_test;
pub mod server;
pub mod server_fetch;
pub mod silences;
pub mod source;
pub mod status;
pub mod status_page;
pub mod template;
pub mod upcoming;
