//! `detail`: what the key's value can no longer tell, read from beside it when the event is taken.
//!
//! Read once per event, for a whole batch of events in one pipeline per database (a mass expiry
//! of 100,000 delayed tasks must not cost 100,000 round trips), stored with the firing so
//! retries use the same copy, and removed only after the firings are handed on.

use std::collections::BTreeMap;

use crate::config::{DetailSource, Rule};
use crate::template::{Context, TemplateSet};

/// Where one event's detail lives, rendered to exact key bytes.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Location {
    Hash {
        #[serde(with = "crate::firing::b64")]
        key: Vec<u8>,
        #[serde(with = "crate::firing::b64")]
        field: Vec<u8>,
    },
    Key {
        #[serde(with = "crate::firing::b64")]
        key: Vec<u8>,
    },
}

/// One event's detail: where to read it, and whether to remove it once the event's jobs are
/// stored (kept in the intake record until it is removed).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Request {
    pub db: u32,
    pub at: Location,
    pub remove: bool,
}

impl Location {
    /// The key a removal would delete (or delete a field of).
    fn key(&self) -> &[u8] {
        match self {
            Location::Hash { key, .. } | Location::Key { key } => key,
        }
    }
}

/// What a detail location is rendered from: the event's key and its captures, which is all the
/// usual locations (`delay:detail` + `{{ id }}`) name, and the full template context, built only
/// for a location that needs more.
pub struct Vars<'a> {
    pub key: &'a [u8],
    pub capture_names: &'a [String],
    pub capture_values: &'a [bytes::Bytes],
    pub context: &'a dyn Fn() -> Context,
}

/// Renders the rule's `detail` location for one event. `own` is `state.prefix`: a detail under
/// it is read but never removed, whatever the key text made the template say (`check` refuses
/// the templates that always land there; this catches the ones a capture steers there).
pub fn request(
    templates: &TemplateSet,
    rule: &Rule,
    db: u32,
    vars: &Vars<'_>,
    own: &[u8],
) -> Option<Result<Request, String>> {
    let d = rule.detail.as_ref()?;
    let context = std::cell::OnceCell::new();
    let verbatim =
        |n: &str| crate::template::verbatim(n, vars.key, vars.capture_names, vars.capture_values);
    let render = |id| {
        templates
            .render_bytes(id, verbatim, &context, vars.context)
            .map_err(|e| format!("detail: {}", e.message))
    };
    let at = match &d.source {
        DetailSource::Hash { key, field } => match (render(*key), render(*field)) {
            (Ok(key), Ok(field)) => Location::Hash { key, field },
            (Err(e), _) | (_, Err(e)) => return Some(Err(e)),
        },
        DetailSource::Key { key } => match render(*key) {
            Ok(key) => Location::Key { key },
            Err(e) => return Some(Err(e)),
        },
    };
    let mut remove = d.remove;
    if remove && at.key().starts_with(own) {
        tracing::warn!(rule = %rule.name, key = %String::from_utf8_lossy(at.key()), "The detail is under `state.prefix`: it is read but not removed (keywatch's own keys are never deleted).");
        remove = false;
    }
    Some(Ok(Request { db, at, remove }))
}

/// What reading one detail gave: its bytes, `None` when there is none, or why it could not be
/// read (an error: the event waits for a retry, its actions never run without it).
pub type Read = Result<Option<Vec<u8>>, String>;

/// Reads the details, one pipeline per database: the fields of one hash in one `HMGET`, so a
/// batch of tasks whose details share a hash (the usual layout) costs Redis one command, not
/// one per task. Each command's answer stands alone: a key of the wrong type fails the details
/// it holds, not the batch.
pub async fn fetch(keyspace: &crate::keyspace::Keyspace, reqs: &[Request]) -> Vec<Read> {
    let mut out: Vec<Read> = vec![Ok(None); reqs.len()];
    let mut by_db: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, r) in reqs.iter().enumerate() {
        by_db.entry(r.db).or_default().push(i);
    }
    for (db, idx) in by_db {
        let plan = Plan::of(idx.iter().map(|&i| (i, &reqs[i].at)), "HMGET", "GET");
        let answer = match keyspace.conn(db).await {
            Ok(c) => c.each_isolated(plan.cmds).await,
            Err(e) => Err(e),
        };
        let answers = match answer {
            Ok(a) => a,
            Err(e) => {
                for &i in &idx {
                    out[i] = Err(format!("Redis: {e}"));
                }
                continue;
            }
        };
        for (targets, v) in plan.targets.iter().zip(answers) {
            match v {
                Ok(redis::Value::Array(items)) => {
                    for (&i, v) in targets.iter().zip(items) {
                        out[i] = redis::from_redis_value(v).map_err(|e| format!("Redis: {e}"));
                    }
                }
                Ok(single) => {
                    for &i in targets {
                        out[i] = redis::from_redis_value(single.clone())
                            .map_err(|e| format!("Redis: {e}"));
                    }
                }
                Err(e) => {
                    for &i in targets {
                        out[i] = Err(format!("Redis: {e}"));
                    }
                }
            }
        }
    }
    out
}

/// Deletes the details marked `remove`, one pipeline per database (one `HDEL` per hash).
pub async fn remove(keyspace: &crate::keyspace::Keyspace, reqs: &[&Request]) -> Result<(), String> {
    let mut by_db: BTreeMap<u32, Vec<&Location>> = BTreeMap::new();
    for r in reqs.iter().filter(|r| r.remove) {
        by_db.entry(r.db).or_default().push(&r.at);
    }
    for (db, at) in by_db {
        let plan = Plan::of(at.into_iter().enumerate(), "HDEL", "UNLINK");
        let c = keyspace
            .conn(db)
            .await
            .map_err(|e| format!("detail removal: Redis: {e}"))?;
        c.each::<redis::Value>(plan.cmds)
            .await
            .map_err(|e| format!("detail removal: Redis: {e}"))?;
    }
    Ok(())
}

/// Fields of one hash per command, at most this many: one command never grows unbounded.
const FIELDS_PER_COMMAND: usize = 1024;

/// The commands for a set of locations: one per hash (its fields together, in chunks of
/// [`FIELDS_PER_COMMAND`]), one per plain key (a key of its own may be anywhere on a cluster).
struct Plan {
    cmds: Vec<redis::Cmd>,
    /// For each command, the callers' indices its answer's items belong to, in order.
    targets: Vec<Vec<usize>>,
}

impl Plan {
    fn of<'a>(
        at: impl Iterator<Item = (usize, &'a Location)>,
        hash_cmd: &str,
        key_cmd: &str,
    ) -> Plan {
        let mut hashes: BTreeMap<&[u8], Vec<(usize, &[u8])>> = BTreeMap::new();
        let mut plan = Plan {
            cmds: Vec::new(),
            targets: Vec::new(),
        };
        for (i, l) in at {
            match l {
                Location::Hash { key, field } => hashes.entry(key).or_default().push((i, field)),
                Location::Key { key } => {
                    let mut c = redis::cmd(key_cmd);
                    c.arg(key);
                    plan.cmds.push(c);
                    plan.targets.push(vec![i]);
                }
            }
        }
        for (key, fields) in hashes {
            for chunk in fields.chunks(FIELDS_PER_COMMAND) {
                let mut c = redis::cmd(hash_cmd);
                c.arg(key);
                for (_, f) in chunk {
                    c.arg(*f);
                }
                plan.cmds.push(c);
                plan.targets.push(chunk.iter().map(|(i, _)| *i).collect());
            }
        }
        plan
    }
}

crate::keyspace::commands::declare! {
    /// The commands reading (and removing) `detail` send ([`crate::keyspace::commands`]).
    [
        Use::new(Server::Watched, "hmget", "detail")
            .on(Keys::DetailHash, Access::Read)
            .args("{key} {field}"),
        Use::new(Server::Watched, "get", "detail")
            .on(Keys::DetailKey, Access::Read)
            .args("{key}"),
        // HDEL reads as it writes: the ACL wants both.
        Use::new(Server::Watched, "hdel", "detail removal")
            .on(Keys::DetailHash, Access::ReadWrite)
            .args("{key} {field}")
            .when(When::DetailRemoved),
        Use::new(Server::Watched, "unlink", "detail removal")
            .on(Keys::DetailKey, Access::Write)
            .args("{key}")
            .when(When::DetailRemoved),

    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(key: &str, field: &str) -> Location {
        Location::Hash {
            key: key.into(),
            field: field.into(),
        }
    }

    #[test]
    fn fields_of_one_hash_share_a_command_and_answers_find_their_caller() {
        let at = [
            hash("d", "1"),
            Location::Key { key: "k".into() },
            hash("e", "9"),
            hash("d", "2"),
        ];
        let plan = Plan::of(at.iter().enumerate(), "HMGET", "GET");
        let cmds: Vec<String> = plan
            .cmds
            .iter()
            .map(crate::keyspace::command_text)
            .collect();
        assert_eq!(cmds, ["GET k", "HMGET d 1 2", "HMGET e 9"]);
        assert_eq!(plan.targets, vec![vec![1], vec![0, 3], vec![2]]);
    }

    #[test]
    fn a_huge_batch_of_one_hash_is_split() {
        let at: Vec<Location> = (0..2500).map(|i| hash("d", &i.to_string())).collect();
        let plan = Plan::of(at.iter().enumerate(), "HDEL", "UNLINK");
        assert_eq!(plan.cmds.len(), 3);
        assert_eq!(plan.targets.iter().map(Vec::len).sum::<usize>(), 2500);
        assert_eq!(plan.targets[2][0], 2048);
    }

    fn config_of(yaml: &str) -> crate::config::Config {
        crate::config::of_yaml(yaml, crate::config::Mode::Check)
    }

    /// An `expired` of `key` in db 0.
    fn expired(key: Vec<u8>) -> crate::event::KeyEvent {
        crate::event::KeyEvent {
            kind: crate::event::EventKind::Expired,
            db: 0,
            key: bytes::Bytes::from(key),
            field: None,
            observed_at: chrono::Utc::now(),
            deadline: None,
            ttl_ms: None,
            recovered: false,
            source: "test".into(),
            place: None,
        }
    }

    #[test]
    fn a_detail_under_the_state_prefix_is_read_but_never_removed() {
        let yaml = r#"
channels:
  log: { type: log }
rules:
  - name: r
    match: "task:{id}"
    detail: { key: "{{ id }}", remove: true }
    notify: { to: [log] }
"#;
        let config = config_of(yaml);
        let rule = &config.rules[0];
        let own = config.state.prefix.as_bytes();
        let request_for = |id: &[u8]| {
            let event = expired([b"task:".as_slice(), id].concat());
            let values = [bytes::Bytes::copy_from_slice(id)];
            let context = || Context::for_event("r", &event, rule.capture_names(), &values, None);
            let vars = Vars {
                key: &event.key,
                capture_names: rule.capture_names(),
                capture_values: &values,
                context: &context,
            };
            request(&config.templates, rule, 0, &vars, own)
                .expect("the rule has a detail")
                .expect("it renders")
        };
        assert!(request_for(b"detail:1").remove);
        let r = request_for(b"keywatch:ledger:0");
        assert_eq!(
            r.at,
            Location::Key {
                key: b"keywatch:ledger:0".to_vec()
            }
        );
        assert!(!r.remove);
    }

    /// A location of literal text, the key and captures is rendered without building the
    /// template context; any other takes the context, and both give minijinja's bytes.
    #[test]
    fn plain_locations_skip_the_context_and_others_use_it() {
        let yaml = r#"
channels:
  log: { type: log }
rules:
  - name: plain
    match: "task:{id}"
    detail: { hash: "d:{{ key }}", field: "{{ id }}" }
    notify: { to: [log] }
  - name: filtered
    match: "task:{id}"
    detail: { hash: "d:{{ key }}", field: "{{ id | lower }}" }
    notify: { to: [log] }
"#;
        let config = config_of(yaml);
        let key = b"task:\xffAB".to_vec();
        let values = [bytes::Bytes::from_static(b"\xffAB")];
        let event = expired(key.clone());
        let located = |i: usize| {
            let rule = &config.rules[i];
            let built = std::cell::Cell::new(0);
            let context = || {
                built.set(built.get() + 1);
                Context::for_event(&rule.name, &event, rule.capture_names(), &values, None)
            };
            let vars = Vars {
                key: &key,
                capture_names: rule.capture_names(),
                capture_values: &values,
                context: &context,
            };
            let r = request(&config.templates, rule, 0, &vars, b"keywatch:")
                .expect("the rule has a detail")
                .expect("it renders");
            (r.at, built.get())
        };
        let hash = [b"d:".as_slice(), &key].concat();
        assert_eq!(
            located(0),
            (
                Location::Hash {
                    key: hash.clone(),
                    field: values[0].to_vec()
                },
                0
            )
        );
        let (at, built) = located(1);
        assert_eq!(
            built, 1,
            "the context is built once for the rule, not per template"
        );
        assert!(matches!(at, Location::Hash { key, .. } if key == hash));
    }
}
