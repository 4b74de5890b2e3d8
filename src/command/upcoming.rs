//! `keywatch upcoming`: keys that expire soon, soonest first, with the rules that match them.
//!
//! Read from keywatch's deadline ledger when it is there and covers what is asked (no
//! `--match`, every rule's deadlines kept); else a paced `SCAN MATCH` + `PEXPIRETIME` walk, as
//! the scanner does. Either way Redis has the last word on each deadline, and keywatch's own keys
//! (under `state.prefix`) are never listed.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

use crate::config::Config;
use crate::event::{EventKind, printable};
use crate::keyspace::Keyspace;
use crate::keyspace::connect;
use crate::metrics::Metrics;
use crate::pattern::Pattern;
use crate::source::ledger::Ledger;
use crate::source::scanner::{ScanWalk, covering_globs, pexpiretime};
use crate::template::human_duration;

pub struct Options {
    pub within: Duration,
    /// `--match`: list this pattern's keys instead of every rule's.
    pub pattern: Option<Pattern>,
    pub redis: Option<String>,
    /// At most this many rows.
    pub limit: usize,
}

/// One key that expires soon.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub key: Vec<u8>,
    /// The hash field, for a field's deadline (`hexpired` rules).
    pub field: Option<Vec<u8>>,
    pub db: u32,
    pub ttl_ms: i64,
    pub deadline_ms: i64,
    /// Names of the rules whose pattern matches the key, in file order.
    pub rules: Vec<String>,
}

impl Row {
    /// The JSON line of `--json` (docs/commands.md).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = self.key_json();
        if let (Some(f), Some(o)) = (&self.field, v.as_object_mut()) {
            o.insert(
                "field".into(),
                String::from_utf8_lossy(f).into_owned().into(),
            );
        }
        v
    }

    fn key_json(&self) -> serde_json::Value {
        serde_json::json!({
            "key": String::from_utf8_lossy(&self.key),
            "db": self.db,
            "ttl_ms": self.ttl_ms,
            "deadline": rfc3339(self.deadline_ms),
            "rules": self.rules,
        })
    }
}

fn rfc3339(ms: i64) -> String {
    DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Which keys are asked for: `--match`, or any rule's pattern.
fn wanted(config: &Config, pattern: Option<&Pattern>, db: u32, key: &[u8]) -> bool {
    if key.starts_with(config.state.prefix.as_bytes()) {
        return false;
    }
    match pattern {
        Some(p) => p.is_match(key),
        None => rules_of(config, db, key).next().is_some(),
    }
}

fn rules_of<'a>(config: &'a Config, db: u32, key: &[u8]) -> impl Iterator<Item = &'a str> {
    let mut idx = Vec::new();
    config.matching_rules(key, &mut idx);
    idx.into_iter()
        .map(|i| &config.rules[i])
        .filter(move |r| r.db.as_ref().is_none_or(|dbs| dbs.contains(&db)))
        .map(|r| r.name.as_str())
}

/// The ledger holds what is asked for only if every rule's deadlines are kept in it.
fn ledger_covers(config: &Config, opts: &Options) -> bool {
    opts.pattern.is_none()
        && config.rules.iter().all(|r| {
            r.on.contains(&EventKind::Expired)
                || r.on.contains(&EventKind::Expiring)
                || r.on == [EventKind::Hexpired]
        })
}

/// The rows, soonest first.
pub async fn collect(config: &Config, opts: &Options) -> Result<Vec<Row>, String> {
    let url = connect::pick_url(
        opts.redis.as_deref(),
        std::env::var("KEYWATCH_REDIS_URL").ok(),
        &config.redis,
    );
    let keyspace = Keyspace::new(url, config.redis.clone()).map_err(|e| e.to_string())?;
    // With Sentinel, the keys and the ledger are on whichever node is the master now.
    keyspace.locate().await.map_err(|e| e.to_string())?;
    let node = keyspace.node();
    let cannot =
        |e: redis::RedisError| format!("Redis at {node}: {}", connect::explain(keyspace.url(), &e));
    // On a cluster, SCAN walks every master.
    keyspace.discover().await.map_err(|e| e.to_string())?;
    let ledger = if ledger_covers(config, opts) {
        let state =
            crate::keyspace::state_conn(config.state.url.as_ref(), &config.redis, &keyspace)
                .await?;
        Some(Ledger::new(
            state,
            keyspace.clone(),
            &config.state.prefix,
            Arc::new(Metrics::new()),
        ))
    } else {
        None
    };
    let now = Utc::now().timestamp_millis();
    let until = now + opts.within.as_millis() as i64;
    let mut found: Vec<(u32, Vec<u8>, i64)> = Vec::new();
    for &db in &config.redis.databases {
        let from_ledger = match &ledger {
            Some(l) => l.any(db).await.map_err(cannot)?,
            None => false,
        };
        let conn = keyspace.conn(db).await.map_err(cannot)?;
        if let (true, Some(l)) = (from_ledger, &ledger) {
            crate::internal_events::DeadlinesRead { db, from: "ledger" }.emit();
            let mut after = crate::store::ledger::Cursor::default();
            let start = found.len();
            loop {
                let rows = l
                    .between(db, now, until, &mut after, 1000)
                    .await
                    .map_err(cannot)?;
                let n = rows.len();
                if n == 0 {
                    break;
                }
                let keys: Vec<Vec<u8>> = rows.into_iter().map(|(k, _)| k).collect();
                let deadlines = pexpiretime(&conn, &keys).await.map_err(cannot)?;
                found.extend(keys.into_iter().zip(deadlines).map(|(k, d)| (db, k, d)));
                // Soonest first: past twice the limit (some may be gone) the rest cannot make it.
                if found.len() - start >= opts.limit * 2 {
                    break;
                }
            }
        } else {
            crate::internal_events::DeadlinesRead { db, from: "scan" }.emit();
            let globs = match &opts.pattern {
                Some(p) => vec![p.scan_glob().to_vec()],
                None => covering_globs(
                    config
                        .rules
                        .iter()
                        .map(|r| r.pattern.scan_glob().to_vec())
                        .collect(),
                ),
            };
            let pace = config
                .scanner
                .as_ref()
                .map_or(50_000, |s| s.max_keys_per_second);
            for node in keyspace.walk_conns(db, None).await.map_err(cannot)? {
                let mut walk = ScanWalk::new(
                    node,
                    conn.clone(),
                    globs.clone(),
                    &config.state.prefix,
                    pace,
                );
                while let Some(batch) = walk.next().await.map_err(cannot)? {
                    found.extend(batch.into_iter().map(|(k, d)| (db, k, d)));
                }
            }
        }
    }
    let mut rows: BTreeMap<(i64, u32, Vec<u8>), Row> = BTreeMap::new();
    let now = Utc::now().timestamp_millis();
    for (db, key, deadline) in found {
        if deadline <= 0 || deadline > until || !wanted(config, opts.pattern.as_ref(), db, &key) {
            continue;
        }
        let rules = rules_of(config, db, &key).map(str::to_string).collect();
        rows.insert(
            (deadline, db, key.clone()),
            Row {
                key,
                field: None,
                db,
                ttl_ms: (deadline - now).max(0),
                deadline_ms: deadline,
                rules,
            },
        );
    }
    if config.watches_fields() {
        let state =
            crate::keyspace::state_conn(config.state.url.as_ref(), &config.redis, &keyspace)
                .await?;
        for row in field_rows(config, opts, &keyspace, state, until)
            .await
            .map_err(cannot)?
        {
            rows.insert(
                (
                    row.deadline_ms,
                    row.db,
                    crate::source::fields::member(
                        &crate::source::fields::HashId::Bytes(row.key.clone()),
                        row.field.as_deref().unwrap_or_default(),
                    ),
                ),
                row,
            );
        }
    }
    Ok(rows.into_values().take(opts.limit).collect())
}

/// The fields the field ledger expects to expire by `until`, each read again from the server.
async fn field_rows(
    config: &Config,
    opts: &Options,
    keyspace: &Keyspace,
    mut state: crate::keyspace::Conn,
    until: i64,
) -> redis::RedisResult<Vec<Row>> {
    use crate::source::fields::FieldLedger;
    let mut out = Vec::new();
    for &db in &config.redis.databases {
        let known =
            FieldLedger::upcoming(&mut state, &config.state.prefix, db, until, opts.limit).await?;
        let conn = keyspace.conn(db).await?;
        let now_deadlines = FieldLedger::deadlines_of(&conn, &known).await?;
        let now = Utc::now().timestamp_millis();
        for ((key, field, _), d) in known.into_iter().zip(now_deadlines) {
            let Some(deadline) = Some(d).filter(|d| *d > 0 && *d <= until) else {
                continue;
            };
            if opts.pattern.as_ref().is_some_and(|p| !p.is_match(&key)) {
                continue;
            }
            let rules = rules_of(config, db, &key)
                .filter(|name| {
                    config.rule(name).is_some_and(|r| {
                        r.watches_fields() && r.captures_of(&key, Some(&field)).is_some()
                    })
                })
                .map(str::to_string)
                .collect();
            out.push(Row {
                key,
                field: Some(field),
                db,
                ttl_ms: (deadline - now).max(0),
                deadline_ms: deadline,
                rules,
            });
        }
    }
    Ok(out)
}

/// Runs the command: prints the rows (a table, or JSON lines); the exit code.
pub fn main(
    config: &Config,
    opts: &Options,
    json: bool,
    rt: &tokio::runtime::Runtime,
) -> std::process::ExitCode {
    let rows = match rt.block_on(collect(config, opts)) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("keywatch upcoming: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    let mut out = std::io::stdout().lock();
    let written = if json {
        write_json(&mut out, &rows)
    } else {
        write_table(&mut out, &rows)
    };
    match written.and_then(|()| out.flush()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // A closed pipe (`| head`) is not an error worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("keywatch upcoming: {e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// A table for people: TTL, deadline, db, key, rules.
pub fn write_table(out: &mut impl Write, rows: &[Row]) -> std::io::Result<()> {
    if rows.is_empty() {
        return writeln!(out, "No key expires within the window.");
    }
    // Hash fields show as `KEY FIELD` in one column, so key-only tables read as before.
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            [
                human_duration(r.ttl_ms),
                rfc3339(r.deadline_ms),
                r.db.to_string(),
                match &r.field {
                    None => printable(&r.key).into_owned(),
                    Some(f) => format!("{} {}", printable(&r.key), printable(f)),
                },
                if r.rules.is_empty() {
                    "-".into()
                } else {
                    r.rules.join(",")
                },
            ]
        })
        .collect();
    let head = ["TTL", "DEADLINE", "DB", "KEY", "RULES"];
    let mut width = head.map(str::len);
    for c in &cells {
        for (w, s) in width.iter_mut().zip(c) {
            *w = (*w).max(s.chars().count());
        }
    }
    let line = |out: &mut dyn Write, c: [&str; 5]| {
        writeln!(
            out,
            "{:<w0$}  {:<w1$}  {:>w2$}  {:<w3$}  {}",
            c[0],
            c[1],
            c[2],
            c[3],
            c[4],
            w0 = width[0],
            w1 = width[1],
            w2 = width[2],
            w3 = width[3],
        )
    };
    line(out, head)?;
    for c in &cells {
        line(out, [&c[0], &c[1], &c[2], &c[3], &c[4]])?;
    }
    Ok(())
}

/// One JSON object per line.
pub fn write_json(out: &mut impl Write, rows: &[Row]) -> std::io::Result<()> {
    for r in rows {
        writeln!(out, "{}", r.to_json())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_and_json_lines() {
        let rows = vec![Row {
            key: b"license:acme".to_vec(),
            field: None,
            db: 0,
            ttl_ms: 90_061_000,
            deadline_ms: 1_795_000_000_000,
            rules: vec!["license-expiring".into()],
        }];
        let mut out = Vec::new();
        write_table(&mut out, &rows).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "TTL    DEADLINE                  DB  KEY           RULES\n\
             1d 1h  2026-11-18T11:06:40.000Z   0  license:acme  license-expiring\n"
        );
        let mut out = Vec::new();
        write_json(&mut out, &rows).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"key": "license:acme", "db": 0, "ttl_ms": 90_061_000,
                "deadline": "2026-11-18T11:06:40.000Z", "rules": ["license-expiring"]})
        );
    }
}
