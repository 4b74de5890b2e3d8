//! keywatch watches a Redis (or Valkey) server for keys that expire, are evicted or are about to
//! expire, matches each key against rules kept in YAML files, and runs what the rules say.
//!
//! Data flows one way: sources → matching → delivery → actions. The external contract (CLI,
//! rule language, payloads, guarantees) is written down in `docs/` (commands.md, rules.md,
//! reliability.md#guarantees, operations.md); this crate is one way to honour it.
//!
//! # Layout
//!
//! Each stage of the pipeline is a folder, and data flows down this list. What
//! `tests/layout.rs` checks is narrower than "no module imports one above it": no two modules
//! or files import each other, directly or around a circle, and the store imports no stage. A
//! later stage is handed what it needs; an earlier one reports back through a channel or
//! callback it is given.
//!
//! Shared vocabulary and rule files:
//! - [`event`]: what happened to which key; the vocabulary every stage shares.
//! - [`long_key`]: the cut view of a key too long to carry whole (its first bytes, length and
//!   a short hash), which messages, links, logs and history are built from.
//! - [`yaml`]: rule files as trees that know every value's line and column; located errors.
//! - [`pattern`]: the key pattern language of docs/rules.md#patterns, and [`pattern::matcher`], every rule's
//!   pattern compiled into one matcher.
//! - [`template`]: Jinja rendering with per-target escaping, so key text never widens an action.
//! - [`outcome`]: how one attempt of an action went.
//! - [`channel`]: where messages go: one [`channel::Integration`] per chat service or webhook,
//!   each in one file (its fields, its request, its idea of success).
//! - [`config`]: rule files → a validated, compiled [`config::Config`]; every problem reported as
//!   `FILE:LINE:COLUMN: message`, all of them in one run. [`config::matching`] answers which
//!   rules an event fires and which keys' deadlines are worth keeping.
//! - [`quiet_hours`]: the windows of `quiet_hours` in the rule files' `timezone`, and when an
//!   instant is quiet and until when (pure arithmetic, clock changes included).
//! - [`firing`]: a matched event of one rule ([`firing::Firing`]) and its jobs
//!   ([`firing::Job`]): the unit every later stage passes on, stores and retries.
//!
//! The pipeline:
//! - [`keyspace`]: the watched Redis (one node or a cluster) and the one keeping keywatch's
//!   state: connections, cluster discovery, the Redis commands each module declares
//!   ([`keyspace::commands`]).
//! - [`source`]: where events come from, as [`source::Signal`]s: keyspace notifications, the
//!   flags they need, the deadline ledger and its poker, the hash-field ledger
//!   ([`source::fields`]), the scanner that warns before deadlines, the subscribers that follow
//!   a cluster's masters, and the Sentinel follower that moves to a new master
//!   ([`source::sentinel`]).
//! - [`engine`]: signals → firings: matching in batches, the intake (claims — one firing per
//!   event, however many instances saw it — and a record of each taken event until its jobs
//!   are stored, so no crash loses it), silences, detail reads, `recover`.
//! - [`delivery`]: runs firings' jobs in order from a durable queue in Redis, retries with
//!   backoff, digests, rate-limited lanes, dead letters.
//! - [`action`]: what a job does: reload, exec, cleanup, notify, an Alertmanager alert, and
//!   the follow-ups of an alert (escalations and resolved notices, [`action::followup`]); and
//!   what it would do, rendered by the same code and not done ([`action::preview`]).
//!
//! What every stage keeps in Redis:
//! - [`store`]: one file per structure keywatch keeps in Redis (the deadline and field
//!   ledgers' keys, the handled memory, intake records and claims, the job queue with targets'
//!   waiting lines and digest windows, dead letters, silences, rate buckets, history,
//!   follow-ups' markers, Alertmanager alerts' ends, the scanner's runs), each
//!   with its key names, leases, Lua (`.lua` files beside it) and Redis commands. The stages
//!   decide and call it; it imports none of them (`tests/layout.rs` checks that too). The
//!   structures are listed in `docs/how-it-works.md` ("What keywatch keeps in Redis").
//!
//! Seen from outside:
//! - [`metrics`]: every metric of docs/operations.md#metrics, defined once.
//! - [`store::history`]: every firing and its actions' outcomes, kept in Redis for
//!   `keywatch history`, `/api/history` and the status page.
//! - [`links`]: signed acknowledge/silence links in messages, and their verification.
//! - [`status`]: readiness, recent firings and their outcomes, dead letters, per-rule counts.
//! - [`command`]: the command line of docs/commands.md and each command: `run` (with its HTTP endpoint,
//!   status page and reloads), `check`, `explain`, `test` (rule unit tests,
//!   [`command::rule_tests`]), `doctor`, `demo`, `send-test`, `upcoming`, `silence`, `dead`.
//! - [`proc_stats`]: peak RSS and CPU time from `/proc`, for the benchmark tools.
//! - [`local_redis`]: a throwaway redis-server for `keywatch demo`, the benchmarks and unit tests,
//!   fetched (a pinned, hash-checked build) where none is installed.
//! - [`drill`]: the crash drill's hook (a kill at a chosen step of an event's path).

pub mod action;
pub(crate) mod allocator;
pub(crate) mod backoff;
pub mod channel;
pub mod command;
pub mod config;
pub(crate) mod delivery;
pub(crate) mod drill;
pub mod engine;
pub mod event;
pub mod firing;
pub(crate) mod internal_events;
pub(crate) mod key_hash;
pub mod keyspace;
pub mod links;
pub mod local_redis;
pub mod long_key;
pub mod metrics;
pub(crate) mod outcome;
pub mod pattern;
pub mod proc_stats;
pub(crate) mod quiet_hours;
pub mod source;
pub(crate) mod status;
pub(crate) mod store;
pub mod template;
pub mod yaml;
