//! The grants the rules need, checked when `run` starts and until they are all there: while the
//! Redis user lacks one, keywatch is not ready (`/readyz` 503 with the grant and the fix) and the
//! log names the `ACL SETUSER` that adds it (docs/redis.md#least-privilege-acl).
//!
//! The check is `doctor`'s own ([`crate::command::doctor::permissions::grants`]): every command
//! `run` sends with the rules in force, checked without running it where the server allows. A
//! command refused for another reason than the ACL (renamed, unknown) does not hold readiness
//! back: `doctor` reports those; only a missing grant, which an operator fixes with one line,
//! does. A permission found missing late (a database whose deadlines are never learnt, on time
//! and recovery silently off for it) was what this replaces.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::command::doctor::permissions::{self, Grants};
use crate::config::{Config, LiveConfig};
use crate::keyspace::Keyspace;
use crate::status::Status;

/// The name of this reason not to be ready, on the status.
const BLOCKER: &str = "grants";

/// How often the grants are checked again while one is missing.
const RECHECK: Duration = Duration::from_secs(5);

/// Checks the grants the rules in force need, now, again every [`RECHECK`] while one is missing,
/// and again after every reload; keywatch is not ready while one is missing.
pub async fn keep(
    mut live: LiveConfig,
    keyspace: Keyspace,
    status: Arc<Status>,
    shutdown: CancellationToken,
) {
    status.block(BLOCKER, "checking the grants the rules need");
    let mut following = true;
    // The last refusal logged: a repeated one is not logged again.
    let mut shown = String::new();
    loop {
        let config = live.current();
        let missing = match check(&config, &keyspace).await {
            Ok(g) => {
                let refused: Vec<&permissions::Refusal> = g
                    .refused
                    .iter()
                    .filter(|r| r.by_acl() && !r.optional)
                    .collect();
                if refused.is_empty() {
                    status.unblock(BLOCKER);
                    if shown != "ok" {
                        crate::internal_events::GrantsComplete {
                            user: &g.user,
                            commands: g.needs,
                            checked: &g.how,
                        }
                        .emit();
                        if !g.unchecked.is_empty() {
                            tracing::warn!(
                                commands = g.unchecked.len(),
                                "Some commands could not be checked without running them; `keywatch doctor` lists them."
                            );
                        }
                        shown = "ok".into();
                    }
                    false
                } else {
                    let reason = refusal(&g, &refused);
                    if reason != shown {
                        let fix = permissions::fixes(&refused).unwrap_or_default();
                        let lacking: Vec<String> =
                            refused.iter().filter_map(|r| r.grant.clone()).collect();
                        crate::internal_events::GrantsMissing {
                            user: &g.user,
                            missing: &lacking.join(" "),
                            fix: &fix,
                            recheck_s: RECHECK.as_secs(),
                        }
                        .emit();
                        shown = reason.clone();
                    }
                    status.block(BLOCKER, &reason);
                    true
                }
            }
            Err(e) => {
                let reason = format!("cannot check the grants the rules need: {e}");
                if reason != shown {
                    tracing::warn!(error = %e, "Cannot check the grants the rules need; trying again.");
                    shown = reason.clone();
                }
                status.block(BLOCKER, &reason);
                true
            }
        };
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            changed = live.changed(), if following => {
                // `None`: nobody reloads any more (the demo, tests).
                following = changed.is_some();
            }
            _ = tokio::time::sleep(RECHECK), if missing => {}
        }
    }
}

/// `/readyz`'s line for what is missing: the commands refused and the fix.
fn refusal(g: &Grants, refused: &[&permissions::Refusal]) -> String {
    let what: Vec<&str> = refused.iter().take(3).map(|r| r.what.as_str()).collect();
    let more = match refused.len() {
        n if n > 3 => format!(" and {} more", n - 3),
        _ => String::new(),
    };
    let fix = permissions::fixes(refused)
        .map(|f| format!("; fix: {}", f.replace('\n', "; ")))
        .unwrap_or_default();
    format!(
        "user {:?} lacks grants the rules need: {}{more} refused{fix}",
        g.user,
        what.join(", ")
    )
}

/// One check of every grant, on the node keywatch watches (the master, with Sentinel; the URL's
/// node of a cluster, which checks the ACL before it redirects).
async fn check(config: &Config, keyspace: &Keyspace) -> Result<Grants, String> {
    let client = keyspace
        .client_for(&keyspace.node())
        .map_err(|e| e.to_string())?;
    let mut conn = crate::command::doctor::open(&client).await.map_err(|e| {
        format!(
            "cannot connect to {}: {}",
            keyspace.node(),
            crate::command::doctor::short(&e)
        )
    })?;
    permissions::grants(config, &client, &mut conn, true).await
}
