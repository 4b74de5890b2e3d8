//! The scanner's marks: when it last ran, `{prefix}scanner:last` (unix ms of the scheduled
//! instant), and which instance runs a scheduled instant, `{prefix}scanner:run:MS` (`SET NX`,
//! held half a period). When to run is the scanner's (`src/source/scanner.rs`); see
//! `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use std::time::Duration;

use crate::keyspace::Conn;

/// When the scanner last ran.
pub fn last(prefix: &str) -> String {
    format!("{prefix}scanner:last")
}

/// The claim of the run of the instant `at_ms`.
pub fn run(prefix: &str, at_ms: i64) -> String {
    format!("{prefix}scanner:run:{at_ms}")
}

/// The scanner's marks on the state server.
pub struct Runs {
    state: Conn,
    prefix: String,
}

impl Runs {
    pub fn new(state: Conn, prefix: &str) -> Runs {
        Runs {
            state,
            prefix: prefix.to_string(),
        }
    }

    /// The instant of the last run (unix ms), if any.
    pub async fn last(&self) -> redis::RedisResult<Option<i64>> {
        redis::cmd("GET")
            .arg(last(&self.prefix))
            .query_async(&mut self.state.clone())
            .await
    }

    /// The run of the instant `at_ms` is done.
    pub async fn ran(&self, at_ms: i64) -> redis::RedisResult<()> {
        redis::cmd("SET")
            .arg(last(&self.prefix))
            .arg(at_ms)
            .query_async(&mut self.state.clone())
            .await
    }

    /// Claims the run of the instant `at_ms` for `instance`, for `hold`: whether it won.
    pub async fn claim(
        &self,
        at_ms: i64,
        instance: &str,
        hold: Duration,
    ) -> redis::RedisResult<bool> {
        let won: Option<String> = redis::cmd("SET")
            .arg(run(&self.prefix, at_ms))
            .arg(instance)
            .arg("NX")
            .arg("PX")
            .arg(hold.as_millis() as u64)
            .query_async(&mut self.state.clone())
            .await?;
        Ok(won.is_some())
    }
}

crate::keyspace::commands::declare! {
    /// The commands of the scanner's marks ([`crate::keyspace::commands`]).
    [
        Use::new(Server::State, "get", "scanner: when it last ran")
            .on(Keys::State("scanner:last"), Access::Read)
            .args("{key}")
            .when(When::Expiring),
        Use::new(Server::State, "set", "scanner: when it last ran")
            .on(Keys::State("scanner:last"), Access::Write)
            .args("{key} 0")
            .when(When::Expiring),
        Use::new(Server::State, "set", "scanner: one instance per run")
            .on(Keys::State("scanner:run:*"), Access::Write)
            .args("{key} 1 NX PX 1000")
            .when(When::Expiring),

    ]
}
