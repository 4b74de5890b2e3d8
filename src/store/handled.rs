//! The handled memory: which deadlines were taken, remembered by *when they were handled* in
//! one hash per minute (`{prefix}ledger:DB:handled:MINUTE`, field: the key, value: its deadline,
//! or `~T` for an expiry taken without a known deadline at `T`), which Redis drops
//! [`HANDLED_MINUTES`] after that minute ends. The intake's take writes it and reads it through the
//! Lua prelude [`RECALLED`]; the ledger's record reads it a minute's hash at a time (`HMGET`). See
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

/// How long a handled deadline is remembered, from the minute it was handled.
pub const HANDLED_MINUTES: i64 = 10;

/// The name of the handled memory of `db` without its minute.
pub fn memory(prefix: &str, db: u32) -> String {
    format!("{prefix}ledger:{db}:handled:")
}

/// Lua put in front of the scripts that read the handled memory (see the file).
pub const RECALLED: &str = include_str!("handled/recalled.lua");

crate::keyspace::commands::declare! {
    /// The commands of [`RECALLED`], run within the intake's take
    /// ([`crate::keyspace::commands`]).
    const SCRIPTS = "ledger: poked keys (script)";
    [
        Use::new(Server::State, "exists", SCRIPTS)
            .on(Keys::State("ledger:*:handled:*"), Access::Read)
            .args("{key}")
            .when(When::Ledger),
        Use::new(Server::State, "hget", SCRIPTS)
            .on(Keys::State("ledger:*:handled:*"), Access::Read)
            .args("{key} k")
            .when(When::Ledger),
    ]
}
