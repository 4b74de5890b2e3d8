//! The open-file limit: raised at start to what the system allows, since every HTTP connection,
//! Redis connection and outgoing request holds a file descriptor, and the endpoint's connections
//! are bounded by it (docs/operations.md#exposing-the-endpoint).

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// What a limit of "unlimited" counts as.
const UNLIMITED: u64 = 1 << 20;

/// Raises the soft limit on open files to the hard limit, logs both, and returns the soft limit
/// now in force.
pub fn raise() -> u64 {
    let before = getrlimit(Resource::Nofile);
    let soft = before.current.unwrap_or(UNLIMITED);
    let hard = before.maximum.unwrap_or(UNLIMITED);
    if soft >= hard {
        return soft;
    }
    let wanted = Rlimit {
        current: before.maximum,
        maximum: before.maximum,
    };
    match setrlimit(Resource::Nofile, wanted) {
        Ok(()) => {
            tracing::info!(
                from = soft,
                to = hard,
                "Raised the limit on open files to the hard limit."
            );
            hard
        }
        Err(e) => {
            tracing::warn!(soft, hard, error = %e, "Cannot raise the limit on open files; keeping the soft limit.");
            soft
        }
    }
}
