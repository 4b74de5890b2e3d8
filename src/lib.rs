//! keywatch watches a Redis (or Valkey) server for keys that expire, are evicted or are about to
//! expire, matches each key against rules kept in YAML files, and runs what the rules say.
//!
//! Data flows one way: sources → matching → queue → actions. The external contract (CLI, rule
//! language, payloads, guarantees) is `SPEC.md`; this crate is one way to honour it.
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
//! - [`explain`]: `keywatch explain`: what would run for a key, rendered, sending nothing.

pub mod cli;
pub mod config;
pub mod event;
pub mod explain;
pub mod matcher;
pub mod pattern;
pub mod template;
