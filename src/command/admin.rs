//! `keywatch silence …` and `keywatch dead …`: the commands that change keywatch's state in
//! Redis while instances run. They read the rules only for `state` (prefix, url) and `redis`.

use std::path::PathBuf;
use std::time::Duration;

use crate::keyspace::Conn;
use chrono::Utc;

use crate::config::{self, Config, Mode};
use crate::engine::silences::{self, Silence};
use crate::firing::rfc3339;
use crate::keyspace::connect;
use crate::pattern::Pattern;
use crate::store::dead::DeadStore;

/// Tells running instances what a command changed (a silence, dead letters back in the queue),
/// with a notice on the watched Redis, so that they act at once rather than at their next safety
/// round (docs/performance.md#an-idle-instance). Not heard, it is found by then: a warning only.
pub async fn announce(
    config: &Config,
    redis_flag: Option<&str>,
    notice: crate::store::notices::Notice,
) {
    let url = connect::pick_url(
        redis_flag,
        std::env::var("KEYWATCH_REDIS_URL").ok(),
        &config.redis,
    );
    let published = async {
        let keyspace =
            crate::keyspace::Keyspace::new(url, config.redis.clone()).map_err(|e| e.to_string())?;
        keyspace.locate().await.map_err(|e| e.to_string())?;
        let mut conn = keyspace.conn(0).await.map_err(|e| e.to_string())?;
        crate::store::notices::publish(&mut conn, &config.state.prefix, notice)
            .await
            .map_err(|e| e.to_string())
    };
    if let Err(e) = tokio::time::timeout(Duration::from_secs(10), published)
        .await
        .unwrap_or_else(|_| Err("no answer within 10 s".into()))
    {
        eprintln!("keywatch: running instances were not told ({e}); they read it within 30 s.");
    }
}

/// The rules (for their state settings) and a connection to the state Redis.
pub async fn open(paths: &[PathBuf], redis_flag: Option<&str>) -> Result<(Config, Conn), String> {
    let env = |name: &str| std::env::var(name).ok();
    let loaded = config::load(paths, Mode::Check, &env).map_err(|e| match e {
        config::LoadError::Unreadable(m) => m,
        config::LoadError::Invalid(diags) => {
            let lines: Vec<String> = diags.iter().map(|d| d.to_string()).collect();
            format!(
                "{}\nthe rules are not valid: fix them first (`keywatch check`)",
                lines.join("\n")
            )
        }
    })?;
    // Shown, not fatal: an unset `${REDIS_PASSWORD}` is otherwise only seen as a refused login.
    for w in &loaded.warnings {
        eprintln!("{w}");
    }
    let config = loaded.config;
    let url = connect::pick_url(
        redis_flag,
        std::env::var("KEYWATCH_REDIS_URL").ok(),
        &config.redis,
    );
    let keyspace =
        crate::keyspace::Keyspace::new(url, config.redis.clone()).map_err(|e| e.to_string())?;
    // With Sentinel, the state is on whichever node is the master now.
    keyspace.locate().await.map_err(|e| e.to_string())?;
    let node = keyspace.node();
    let conn = tokio::time::timeout(
        Duration::from_secs(30),
        crate::keyspace::state_conn(config.state.url.as_ref(), &config.redis, &keyspace),
    )
    .await
    .map_err(|_| format!("cannot connect to Redis at {node}: timed out"))??;
    Ok((config, conn))
}

pub async fn silence_add(
    config: &Config,
    conn: &mut Conn,
    rule: &str,
    pattern: Option<&str>,
    duration: Duration,
    comment: &str,
) -> Result<String, String> {
    if config.rule(rule).is_none() {
        let names: Vec<&str> = config.rules.iter().map(|r| r.name.as_str()).collect();
        return Err(format!(
            "no rule `{rule}` in the rules{}",
            crate::yaml::diagnostic::did_you_mean(rule, names.iter().copied())
        ));
    }
    if let Some(p) = pattern {
        Pattern::parse(p).map_err(|e| format!("--match `{p}`: {e}"))?;
    }
    let now = Utc::now();
    let s = Silence {
        id: silences::new_id(),
        rule: rule.to_string(),
        pattern: pattern.map(str::to_string),
        key: None,
        key_sha256: None,
        until: now + chrono::Duration::from_std(duration).map_err(|e| e.to_string())?,
        comment: comment.to_string(),
        created: now,
        by: std::env::var("USER").unwrap_or_else(|_| "unknown".into()),
    };
    silences::add(conn, &config.state.prefix, &s)
        .await
        .map_err(|e| e.to_string())?;
    Ok(format!(
        "silence {} added: rule {}{} muted until {}",
        s.id,
        s.rule,
        s.pattern
            .as_deref()
            .map(|p| format!(" (keys matching {p})"))
            .unwrap_or_default(),
        rfc3339(s.until)
    ))
}

pub async fn silence_list(config: &Config, conn: &mut Conn, json: bool) -> Result<String, String> {
    let prefix = &config.state.prefix;
    silences::expire(conn, prefix)
        .await
        .map_err(|e| e.to_string())?;
    let list = silences::list(conn, prefix)
        .await
        .map_err(|e| e.to_string())?;
    if json {
        return Ok(list
            .iter()
            .map(|s| {
                let mut v = serde_json::to_value(s).unwrap_or_default();
                if let (Some(e), Some(m)) = (s.invalid_pattern(), v.as_object_mut()) {
                    m.insert("invalid_pattern".into(), e.into());
                }
                v.to_string() + "\n"
            })
            .collect());
    }
    if list.is_empty() {
        return Ok("no silences\n".into());
    }
    let mut out = format!(
        "{:<10} {:<28} {:<24} {:<26} {}\n",
        "ID", "RULE", "MATCH", "UNTIL", "COMMENT"
    );
    let now = Utc::now();
    for s in list {
        let comment = match (s.exact_key(), s.invalid_pattern(), s.refused(now)) {
            (Some(Err(_)), _, _) => format!(
                "INVALID KEY (not base64): ignored, mutes nothing; {}",
                s.comment
            ),
            (None, Some(e), _) if s.key_sha256.is_none() => format!(
                "INVALID PATTERN ({e}): ignored, mutes nothing; {}",
                s.comment
            ),
            (_, _, Some(why)) => format!("REFUSED ({why}): ignored, mutes nothing; {}", s.comment),
            _ => s.comment.clone(),
        };
        // A link's silence names its key; both may hold anyone's text.
        let comment = crate::event::printable(comment.as_bytes());
        // A link's silence mutes exactly its key: shown by its bytes, as keys are shown
        // everywhere, not by its pattern (which cannot spell bytes that are not UTF-8).
        let mutes = match s.key_shown() {
            Some(key) => key,
            None => {
                crate::event::printable(s.pattern.as_deref().unwrap_or("*").as_bytes()).into_owned()
            }
        };
        out.push_str(&format!(
            "{:<10} {:<28} {:<24} {:<26} {}\n",
            s.id,
            s.rule,
            mutes,
            rfc3339(s.until),
            comment
        ));
    }
    Ok(out)
}

pub async fn silence_remove(config: &Config, conn: &mut Conn, id: &str) -> Result<String, String> {
    match silences::remove(conn, &config.state.prefix, id)
        .await
        .map_err(|e| e.to_string())?
    {
        true => Ok(format!("silence {id} removed")),
        false => Err(format!("no silence {id} (see `keywatch silence list`)")),
    }
}

pub async fn dead_list(
    config: &Config,
    conn: &Conn,
    json: bool,
    limit: usize,
) -> Result<String, String> {
    let store = DeadStore::new(conn.clone(), &config.state.prefix);
    let list = store.list(limit).await.map_err(|e| e.to_string())?;
    if json {
        return Ok(list
            .iter()
            .map(|d| serde_json::to_string(d).unwrap_or_default() + "\n")
            .collect());
    }
    if list.is_empty() {
        return Ok("no dead letters\n".into());
    }
    let mut out = format!(
        "{:<14} {:<26} {:<24} {:<16} {:<28} {}\n",
        "ID", "AT", "RULE", "ACTION", "KEY", "REASON"
    );
    for d in list {
        let action = match &d.action {
            crate::firing::Action::Notify { channel } => format!("notify:{channel}"),
            crate::firing::Action::Alert { channel, target } => {
                format!("notify:{channel}:{target}")
            }
            a => a.name().to_string(),
        };
        out.push_str(&format!(
            "{:<14} {:<26} {:<24} {:<16} {:<28} {}\n",
            d.id,
            rfc3339(d.at),
            d.rule,
            action,
            crate::event::printable(d.key.as_bytes()),
            crate::event::printable(d.reason.as_bytes())
        ));
    }
    Ok(out)
}

pub async fn dead_retry(config: &Config, conn: &Conn, ids: &[String]) -> Result<String, String> {
    let r = DeadStore::new(conn.clone(), &config.state.prefix)
        .retry(ids)
        .await
        .map_err(|e| e.to_string())?;
    let mut out = format!(
        "{} dead letter(s) put back in the queue: a running instance sends them now, or the next one to start",
        r.moved
    );
    if !r.kept.is_empty() {
        out.push_str(&format!(
            "\n{} kept: they hold no event to send again (a stored job this version could not read; see `dead list`): {}",
            r.kept.len(),
            r.kept.join(", ")
        ));
    }
    Ok(out)
}

pub async fn dead_drop(config: &Config, conn: &Conn, ids: &[String]) -> Result<String, String> {
    let n = DeadStore::new(conn.clone(), &config.state.prefix)
        .drop_letters(ids)
        .await
        .map_err(|e| e.to_string())?;
    Ok(format!("{n} dead letter(s) dropped"))
}
