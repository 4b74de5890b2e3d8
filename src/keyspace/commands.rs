//! The Redis commands a module sends, declared beside the code that sends them.
//!
//! A least-privilege ACL user must be granted exactly what keywatch sends, and `keywatch doctor`
//! must check exactly that: a list kept apart from the code drifts (it once checked a claims key
//! that no longer existed). So each module that talks to Redis declares its commands in a
//! [`Uses`] next to its code; the doctor's permission check and the documented ACL lines are
//! derived from those declarations, and a test fails when a file sends a command its module did
//! not declare, or declares one it no longer sends.

/// Which connection a command goes to: the watched Redis, or the one keeping keywatch's state
/// (`state.url`, else the watched one). With `state.url` they may be different users.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Server {
    Watched,
    State,
    /// A sentinel of `redis.sentinel`: its ACL is its own, documented apart.
    Sentinel,
}

/// What a command does to its keys; for a command without keys, to the server or connection
/// (`SELECT` changes the connection, so it is no read). Only reads may be run for real when
/// nothing else can check a permission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    Read,
    Write,
    ReadWrite,
}

impl Access {
    /// The ACL key-permission selector that grants it.
    pub fn selector(self) -> &'static str {
        match self {
            Access::Read => "%R~",
            Access::Write => "%W~",
            Access::ReadWrite => "~",
        }
    }
}

/// The keys a command touches: what an ACL must grant, and what a sample invocation names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keys {
    None,
    /// keywatch's own key: `state.prefix` followed by this glob (`queue`, `claims:*:*`).
    State(&'static str),
    /// The keys a rule watches (its pattern's glob).
    Watched,
    /// The hash a rule's `detail` reads a field of (`{field}` names the field).
    DetailHash,
    /// The key a rule's `detail` reads.
    DetailKey,
    /// What a rule's `cleanup` deletes (`delete:`; `{glob}` is the pattern).
    CleanupDelete,
    /// The hashes a rule's `cleanup` removes fields from (`hdel:`; `{field}` names the field).
    CleanupHash,
}

/// A pub/sub channel a command names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PubSub {
    /// `__keyevent@{db}__:{event}`, for each database and event the rules need.
    Keyevent,
    /// The ledger's marker channel, `{prefix}poke`.
    Marker,
}

/// Which configurations make keywatch send a command: the doctor checks only what the rules
/// at hand need, and the documented base ACL line leaves out what only some setups need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Every `keywatch run`.
    Always,
    /// Rules on `expired` or `expiring`, whose keys the ledger follows.
    Ledger,
    /// Rules on `expiring`, whose keys the scanner looks ahead at.
    Expiring,
    /// Rules on `hexpired`, whose hashes' field deadlines the field ledger follows.
    Fields,
    /// `redis.notifications: enable`.
    EnableNotifications,
    /// Each watched database other than 0.
    OtherDatabase,
    /// `redis.cluster: true`.
    Cluster,
    /// `redis.sentinel`: sent to the sentinels, never to a data node.
    Sentinel,
    /// A channel with a `rate`.
    RateLimit,
    /// A rule's `detail` with `remove: true`.
    DetailRemoved,
    /// A rule's `cleanup`: what it deletes is the rule's to say, so the ACL line is too.
    Cleanup,
    /// Only `keywatch doctor`, to look without changing anything; granted so that it can.
    Doctor,
    /// Only `keywatch doctor`, which does without when refused. Not granted: `ACL DRYRUN` would
    /// let the user test any other user's permissions.
    DoctorOptional,
    /// Plumbing that sends a command for its callers, whose own declarations say on what.
    ForCallers,
}

impl When {
    /// Whether the documented base ACL line grants it: what every setup needs, and what lets
    /// the doctor check the rest. The docs name the others one by one.
    pub fn in_base_acl(self) -> bool {
        !matches!(
            self,
            When::EnableNotifications
                | When::Fields
                | When::OtherDatabase
                | When::Cluster
                | When::Sentinel
                | When::DetailRemoved
                | When::Cleanup
                | When::DoctorOptional
        )
    }
}

/// One command a module sends.
#[derive(Clone, Copy, Debug)]
pub struct Use {
    pub server: Server,
    /// The ACL name: `zadd`, `config|get`. A `|` separates a subcommand, as the ACL writes it.
    pub command: &'static str,
    /// A sample invocation's arguments after the command's words, separated by spaces, in a
    /// shape the server accepts (`ACL DRYRUN` checks arity). Placeholders: `{key}` (a key of
    /// [`Use::keys`]), `{prefix}` (`state.prefix`), `{glob}`, `{field}`, `{channel}`, `{db}`,
    /// `{flags}` (the notify flags the rules need), `{sha}` (a script's SHA-1).
    pub args: &'static str,
    pub keys: Keys,
    pub access: Access,
    pub channel: Option<PubSub>,
    pub when: When,
    /// Why keywatch sends it, for the operator reading a refusal.
    pub why: &'static str,
    /// `run` does without it when refused, and says what that costs: readiness does not wait
    /// for it, and `doctor` warns rather than fails.
    pub optional: bool,
}

impl Use {
    /// A read without keys or channel, sent in every run; the methods below say otherwise.
    pub const fn new(server: Server, command: &'static str, why: &'static str) -> Use {
        Use {
            server,
            command,
            args: "",
            keys: Keys::None,
            access: Access::Read,
            channel: None,
            when: When::Always,
            why,
            optional: false,
        }
    }

    pub const fn optional(mut self) -> Use {
        self.optional = true;
        self
    }

    pub const fn on(mut self, keys: Keys, access: Access) -> Use {
        self.keys = keys;
        self.access = access;
        self
    }

    pub const fn args(mut self, args: &'static str) -> Use {
        self.args = args;
        self
    }

    pub const fn access(mut self, access: Access) -> Use {
        self.access = access;
        self
    }

    pub const fn channel(mut self, channel: PubSub) -> Use {
        self.channel = Some(channel);
        self
    }

    pub const fn when(mut self, when: When) -> Use {
        self.when = when;
        self
    }

    /// The command's words as sent: `config|get` is `CONFIG GET`.
    pub fn words(&self) -> Vec<String> {
        self.command
            .split('|')
            .map(|w| w.to_ascii_uppercase())
            .collect()
    }
}

/// Every command one source file sends (with the files of its submodules, if they declare
/// none of their own).
#[derive(Debug)]
pub struct Uses {
    /// The declaring file, `file!()`: where the guard test looks for the commands.
    pub file: &'static str,
    pub uses: &'static [Use],
}

/// Declares a module's commands as its `REDIS`: doc comments, then `const NAME = "…";` for
/// texts several uses share, then the uses in brackets.
macro_rules! declare {
    ($(#[$m:meta])* $(const $name:ident = $text:expr;)* [$($u:expr),* $(,)?]) => {
        $(#[$m])*
        pub const REDIS: $crate::keyspace::commands::Uses = {
            #[allow(unused_imports)]
            use $crate::keyspace::commands::{Access, Keys, PubSub, Server, Use, Uses, When};
            $(const $name: &str = $text;)*
            Uses {
                file: file!(),
                uses: &[$($u),*],
            }
        };
    };
}
pub(crate) use declare;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subcommands_are_sent_as_two_words() {
        let u = Use::new(Server::Watched, "config|get", "t");
        assert_eq!(u.words(), ["CONFIG", "GET"]);
        assert_eq!(Use::new(Server::State, "zadd", "t").words(), ["ZADD"]);
    }
}
