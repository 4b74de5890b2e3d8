//! The end-to-end suites, one module per suite, built as one test binary.
//!
//! One binary instead of one per suite: each integration-test binary links the whole crate and
//! its dependencies, and 30 of them took longer to build than the suite takes to run. Run one
//! suite with its module's name as the filter, `cargo test --test e2e pipeline::`, one test with
//! its path, `cargo test --test e2e ledger::expiries_while_keywatch_is_down_are_recovered_once`
//! (docs/development.md#running-one-suite-or-one-test).
//!
//! The suites share one process, so nothing in them or in the harness may rely on process-wide
//! state that one test changes for the others: no `std::env::set_var`, no current directory,
//! no signal handlers; ports are handed out once per process (`common::ports`), which is what
//! keeps tests in parallel threads apart.
//!
//! `tests/common/` stays where it was, so that a new top-level `tests/NAME.rs` can still say
//! `mod common;` and build as a binary of its own.

#[path = "../common/mod.rs"]
mod common;

mod acl;
mod admin;
mod alertmanager;
mod backlog;
mod channels;
mod chatops;
mod check_fixtures;
mod cluster;
mod crash_drill;
mod deploy;
mod docs;
mod doctor;
mod drills;
mod email;
mod endpoint_protection;
mod endpoints;
mod flushes;
mod followups;
mod forged_state;
mod guarantees;
mod harness;
mod hash_fields;
mod history;
mod hostile_input;
mod instances;
mod intake;
mod ledger;
mod long_keys;
mod pattern_scan;
mod pipeline;
mod quiet_hours;
mod reload;
mod rule_tests;
mod scanner;
mod sentinel;
mod server_events;
mod shadow;
mod status_page;
mod storm;
mod tls;
