//! Who besides keywatch may write keywatch's state (docs/redis.md#keep-applications-out-of-keywatchs-state):
//! every enabled user of the Redis that holds it (`state.url`, or the watched one) that `ACL
//! DRYRUN` says may write under `state.prefix`, keywatch's own user aside. An application that
//! can write there can silence alerts, acknowledge escalations and fill the dead letters; the
//! doctor says so, with the ACL lines that keep it out.

use redis::aio::MultiplexedConnection;

use super::report::Report;
use super::{open, short, whoami};
use crate::config::Config;
use crate::keyspace::connect;

/// The check's name in the report.
const NAME: &str = "state access";

/// The user docs/redis.md#least-privilege-acl makes for keywatch.
const KEYWATCH_USER: &str = "keywatch";

/// Warns when users other than keywatch's may write under `state.prefix` on the Redis holding
/// keywatch's state; says when that cannot be known.
pub async fn check(
    report: &mut Report,
    config: &Config,
    client: &redis::Client,
    conn: &mut MultiplexedConnection,
) {
    let prefix = &config.state.prefix;
    let (mut conn, own) = match &config.state.url {
        None => (conn.clone(), whoami(client, conn).await),
        Some(url) => {
            let opened = match connect::client(url, &config.redis, 0) {
                Ok((c, _)) => open(&c).await.map(|sc| (c, sc)).map_err(|e| short(&e)),
                Err(e) => Err(e.to_string()),
            };
            match opened {
                Ok((c, mut sc)) => {
                    let own = whoami(&c, &mut sc).await;
                    (sc, own)
                }
                // The permission check reports the state Redis unreachable.
                Err(_) => return,
            }
        }
    };
    let users: Vec<String> = match redis::cmd("ACL").arg("USERS").query_async(&mut conn).await {
        Ok(u) => u,
        Err(e) if short(&e).to_ascii_lowercase().contains("unknown command") => {
            report.warn(
                NAME,
                format!("this server has no ACLs: every client may write keywatch's state ({prefix}*) and so silence alerts, acknowledge escalations and fill the dead letters"),
                Some("keep keywatch's state in a Redis only keywatch reaches (`state.url`): docs/redis.md#keep-applications-out-of-keywatchs-state".into()),
            );
            return;
        }
        Err(e) => {
            report.warn(
                NAME,
                format!(
                    "who else may write keywatch's state ({prefix}*) is not known: ACL USERS was refused ({})",
                    short(&e)
                ),
                Some("run doctor as a user allowed ACL USERS, ACL GETUSER and ACL DRYRUN (an administrator)".into()),
            );
            return;
        }
    };
    let mut writers = Vec::new();
    let mut unknown = Vec::new();
    for user in users {
        // keywatch's own user writes there by design — the one doctor runs as, or the one
        // docs/redis.md names `keywatch` when doctor runs as an administrator — unless it is the
        // default user, which is every client's that does not log in.
        if (user == own || user == KEYWATCH_USER) && user != "default" {
            continue;
        }
        match may_write(&mut conn, &user, prefix).await {
            Ok(true) => writers.push(user),
            Ok(false) => {}
            Err(why) => unknown.push(format!("{user}: {why}")),
        }
    }
    if !unknown.is_empty() {
        report.warn(
            NAME,
            format!(
                "whether {} user(s) may write keywatch's state ({prefix}*) is not known:\n{}",
                unknown.len(),
                unknown.join("\n")
            ),
            Some(
                "run doctor as a user allowed ACL GETUSER and ACL DRYRUN (an administrator)".into(),
            ),
        );
    }
    if writers.is_empty() {
        if unknown.is_empty() {
            report.ok(
                NAME,
                format!("no user but keywatch's may write its state ({prefix}*)"),
            );
        }
        return;
    }
    report.warn(
        NAME,
        format!(
            "user(s) {} may write keywatch's state ({prefix}*){}: an application logged in as one could silence alerts, acknowledge escalations, fill the dead letters and put jobs in the queue (which keywatch refuses unless the rules say the same for a real key)",
            writers
                .iter()
                .map(|u| format!("{u:?}"))
                .collect::<Vec<_>>()
                .join(", "),
            if writers.contains(&own) {
                format!(", keywatch's own {own:?} among them")
            } else {
                String::new()
            }
        ),
        Some(fix(config, &writers, &own)),
    );
}

/// Whether `user` is enabled and may `SET` a key under `prefix`, by `ACL GETUSER` and `ACL
/// DRYRUN` (nothing runs).
async fn may_write(
    conn: &mut MultiplexedConnection,
    user: &str,
    prefix: &str,
) -> Result<bool, String> {
    let described: redis::Value = redis::cmd("ACL")
        .arg("GETUSER")
        .arg(user)
        .query_async(conn)
        .await
        .map_err(|e| format!("ACL GETUSER: {}", short(&e)))?;
    if flags(&described).iter().any(|f| f == "off") {
        return Ok(false);
    }
    let probe = format!("{prefix}doctor:probe");
    match redis::cmd("ACL")
        .arg("DRYRUN")
        .arg(user)
        .arg("SET")
        .arg(&probe)
        .arg("1")
        .query_async::<redis::Value>(conn)
        .await
    {
        Ok(redis::Value::Okay) => Ok(true),
        Ok(redis::Value::SimpleString(s)) if s == "OK" => Ok(true),
        Ok(_) => Ok(false),
        Err(e) => Err(format!("ACL DRYRUN: {}", short(&e))),
    }
}

/// The `flags` of an `ACL GETUSER` answer (RESP2 pairs or a RESP3 map).
fn flags(described: &redis::Value) -> Vec<String> {
    use redis::Value;
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let list = |v: &Value| match v {
        Value::Array(items) | Value::Set(items) => items.iter().filter_map(text).collect(),
        _ => Vec::new(),
    };
    match described {
        Value::Array(items) => items
            .chunks(2)
            .find(|p| p.first().and_then(text).as_deref() == Some("flags"))
            .and_then(|p| p.get(1))
            .map(list)
            .unwrap_or_default(),
        Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| text(k).as_deref() == Some("flags"))
            .map(|(_, v)| list(v))
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// The ACL lines that keep `writers` out of keywatch's state. Redis ACLs grant key patterns and
/// cannot take one away from "all keys", so an application's user is given the patterns of the
/// keys it writes instead: the rules' (the keys keywatch watches), to which it adds its others.
fn fix(config: &Config, writers: &[String], own: &str) -> String {
    let prefix = &config.state.prefix;
    let mut globs: Vec<String> = config
        .rules
        .iter()
        .map(|r| String::from_utf8_lossy(r.pattern.scan_glob()).into_owned())
        .collect();
    globs.sort();
    globs.dedup();
    let patterns: String = globs.iter().map(|g| format!(" ~{g}")).collect();
    let overlaps = globs
        .iter()
        .any(|g| g == "*" || prefix.starts_with(g.trim_end_matches('*')));
    let mut lines = vec![
        "give each application a user of its own whose key patterns leave out keywatch's state (Redis ACLs cannot take one pattern away from `~*`; add the other keys it writes):".to_string(),
    ];
    for w in writers {
        if w == "default" {
            lines.push(format!(
                "  ACL SETUSER app on >APP_PASSWORD resetkeys{patterns} +@all -@admin -@dangerous"
            ));
            lines.push("  ACL SETUSER default off".into());
        } else {
            lines.push(format!("  ACL SETUSER {w} resetkeys{patterns}"));
        }
    }
    if writers.iter().any(|w| w == own) {
        lines.push(format!(
            "  and keywatch a user of its own: the lines of docs/redis.md#least-privilege-acl (`ACL SETUSER keywatch … ~{prefix}* …`)"
        ));
    }
    if overlaps {
        lines.push(format!(
            "a rule's pattern covers keywatch's state ({prefix}*): keep the state in a Redis of its own instead (`state.url`)"
        ));
    } else {
        lines
            .push("or keep keywatch's state in a Redis only keywatch reaches (`state.url`)".into());
    }
    lines.push("(docs/redis.md#keep-applications-out-of-keywatchs-state)".into());
    lines.join("\n")
}

crate::keyspace::commands::declare! {
    /// The commands the doctor sends to see who may write keywatch's state
    /// ([`crate::keyspace::commands`]).
    const WHY = "doctor: who besides keywatch may write its state";
    [
        Use::new(Server::State, "acl|users", WHY).when(When::DoctorOptional),
        Use::new(Server::State, "acl|getuser", WHY)
            .args("default")
            .when(When::DoctorOptional),
        Use::new(Server::State, "acl|dryrun", WHY)
            .args("default SET {key} 1")
            .when(When::DoctorOptional),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_read_from_either_protocol() {
        use redis::Value::*;
        let resp2 = Array(vec![
            BulkString(b"flags".to_vec()),
            Array(vec![BulkString(b"off".to_vec())]),
            BulkString(b"passwords".to_vec()),
            Array(vec![]),
        ]);
        assert_eq!(flags(&resp2), ["off"]);
        let resp3 = Map(vec![(
            SimpleString("flags".into()),
            Set(vec![
                SimpleString("on".into()),
                SimpleString("nopass".into()),
            ]),
        )]);
        assert_eq!(flags(&resp3), ["on", "nopass"]);
    }

    #[test]
    fn the_fix_lists_the_rules_key_patterns_and_the_other_way() {
        let config = crate::config::of_yaml(
            "channels:\n  log: { type: log }\nrules:\n  - name: r\n    match: 'order_lock:{id}'\n    notify: { to: [log] }\n",
            crate::config::Mode::Check,
        );
        let f = fix(&config, &["default".into(), "app".into()], "kw");
        assert!(
            f.contains("ACL SETUSER app on >APP_PASSWORD resetkeys ~order_lock:*"),
            "{f}"
        );
        assert!(f.contains("ACL SETUSER default off"), "{f}");
        assert!(f.contains("ACL SETUSER app resetkeys ~order_lock:*"), "{f}");
        assert!(f.contains("state.url"), "{f}");
    }
}
