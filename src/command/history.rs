//! `keywatch history`: what fired, for which key, where it went and how it ended, read from what
//! every instance recorded in Redis ([`crate::store::history`]).

use crate::config::Config;
use crate::keyspace::Conn;
use crate::store::history::{self, Filter, Record};

/// The listing: a table for people, or one JSON object per firing (`--json`).
pub async fn run(
    config: &Config,
    mut conn: Conn,
    filter: &Filter,
    json: bool,
) -> Result<String, String> {
    let records = history::list(&mut conn, &config.state.prefix, filter)
        .await
        .map_err(|e| format!("cannot read the history: {e}"))?;
    if json {
        return Ok(records
            .iter()
            .map(|r| r.to_json().to_string() + "\n")
            .collect());
    }
    if records.is_empty() {
        return Ok("no firings recorded (for these filters)\n".into());
    }
    Ok(table(&records))
}

/// One line per firing, then one indented line per action.
pub fn table(records: &[Record]) -> String {
    let mut out = format!(
        "{:<26} {:<24} {:<9} {}\n",
        "OBSERVED", "RULE", "EVENT", "KEY"
    );
    for r in records {
        let followup = r
            .event
            .get("followup")
            .and_then(|f| f.as_str())
            .map(|f| format!(" ({f})"))
            .unwrap_or_default();
        let recovered = if r.event["recovered"] == true {
            " (recovered)"
        } else {
            ""
        };
        out.push_str(&format!(
            "{:<26} {:<24} {:<9} {}{recovered}{followup}\n",
            r.str_field("observed_at"),
            r.str_field("rule"),
            r.str_field("event"),
            crate::event::printable(r.str_field("key").as_bytes()),
        ));
        for a in &r.actions {
            let what = match &a.channel {
                Some(c) => format!("{}:{c}", a.action),
                None => a.action.clone(),
            };
            let error = a
                .last_error
                .as_deref()
                .map(|e| format!("  {}", crate::event::printable(e.as_bytes())))
                .unwrap_or_default();
            out.push_str(&format!(
                "    {what:<22} {:<9} attempts {:<3} at {}{error}\n",
                a.outcome, a.attempts, a.at
            ));
        }
    }
    out
}
