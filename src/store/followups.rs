//! Follow-ups' state: the marker of an alert whose follow-ups wait,
//! `{prefix}followup:RULE:DB:KEY` (the key's exact bytes; value: the firing's id, expiring when
//! its longest follow-up is due), and an alert's acknowledgement, `{prefix}ack:FIRING` (written
//! by a signed link, read before an escalation). What follows up when is the actions'
//! (`src/action/followup.rs`); see `docs/how-it-works.md#what-keywatch-keeps-in-redis`.

use crate::keyspace::Conn;

/// Set by an acknowledgement of the alert `firing_id` (a signed link); its escalations stop.
pub fn ack_key(prefix: &str, firing_id: &str) -> String {
    format!("{prefix}ack:{firing_id}")
}

/// Names the alert of `rule` on `key` whose follow-ups wait, so that hearing the key again
/// finds their jobs (`{prefix}followup:RULE:DB:KEY`, the key's exact bytes; a key longer than
/// [`crate::long_key::EXACT`] by its SHA-256, `…:DB:#sha256:HEX`, so that the marker's name does
/// not grow with the key: docs/reliability.md#bounded-whatever-the-key).
pub fn marker_key(prefix: &str, rule: &str, db: u32, key: &[u8]) -> Vec<u8> {
    let mut k = format!("{prefix}followup:{rule}:{db}:").into_bytes();
    if crate::long_key::is_long(key) {
        k.extend_from_slice(format!("#sha256:{}", crate::long_key::sha256_hex(key)).as_bytes());
    } else {
        k.extend_from_slice(key);
    }
    k
}

/// Stores the marker of the alert `firing_id` of `rule` on `key` for `ms`, in the caller's
/// transaction.
pub fn marker_cmd(
    prefix: &str,
    rule: &str,
    db: u32,
    key: &[u8],
    firing_id: &str,
    ms: i64,
) -> redis::Cmd {
    let mut set = redis::cmd("SET");
    set.arg(marker_key(prefix, rule, db, key))
        .arg(firing_id)
        .arg("PX")
        .arg(ms);
    set
}

/// Makes the queued jobs `ids` due now, if they are still waiting (`ZADD XX`: a job already
/// done stays gone).
pub fn due_now_cmd(prefix: &str, ids: &[String], now_ms: i64) -> redis::Cmd {
    let mut c = redis::cmd("ZADD");
    c.arg(crate::store::queue::keys::queue(prefix)).arg("XX");
    for id in ids {
        c.arg(now_ms).arg(id);
    }
    c
}

/// Whether the alert `firing_id` was acknowledged.
pub async fn acknowledged(
    state: &mut Conn,
    prefix: &str,
    firing_id: &str,
) -> redis::RedisResult<bool> {
    let n: i64 = redis::cmd("EXISTS")
        .arg(ack_key(prefix, firing_id))
        .query_async(state)
        .await?;
    Ok(n > 0)
}

/// Acknowledges the alert `firing_id` for `ms`.
pub async fn acknowledge(
    state: &mut Conn,
    prefix: &str,
    firing_id: &str,
    ms: i64,
) -> redis::RedisResult<()> {
    redis::cmd("SET")
        .arg(ack_key(prefix, firing_id))
        .arg(chrono::Utc::now().to_rfc3339())
        .arg("PX")
        .arg(ms)
        .query_async::<()>(state)
        .await
}

/// The markers of one key's alerts, one per rule.
pub struct Markers<'a> {
    state: Conn,
    prefix: &'a str,
    keys: Vec<Vec<u8>>,
}

impl<'a> Markers<'a> {
    /// The markers named `keys` ([`marker_key`]).
    pub fn new(state: Conn, prefix: &'a str, keys: Vec<Vec<u8>>) -> Markers<'a> {
        Markers {
            state,
            prefix,
            keys,
        }
    }

    /// The firing id each marker names, in the order of the rules.
    pub async fn read(&self) -> redis::RedisResult<Vec<Option<String>>> {
        redis::cmd("MGET")
            .arg(&self.keys)
            .query_async(&mut self.state.clone())
            .await
    }

    /// Makes the queued jobs of each of `due` due at `now_ms`, if they are still waiting
    /// (`ZADD XX`: a job already done stays gone), and drops the markers, in one round trip.
    pub async fn bring_forward(&self, due: &[Vec<String>], now_ms: i64) -> redis::RedisResult<()> {
        let mut p = redis::pipe();
        for ids in due {
            p.add_command(due_now_cmd(self.prefix, ids, now_ms))
                .ignore();
        }
        let mut del = redis::cmd("DEL");
        del.arg(&self.keys);
        p.add_command(del).ignore();
        p.query_async(&mut self.state.clone()).await
    }
}

crate::keyspace::commands::declare! {
    /// The commands follow-ups and signed links send to follow-ups' state
    /// ([`crate::keyspace::commands`]).
    const WHY = "escalate and resolved";
    [
        Use::new(Server::State, "exists", WHY)
            .on(Keys::State("ack:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "zadd", WHY)
            .on(Keys::State("queue"), Access::Write)
            .args("{key} XX 0 id"),
        Use::new(Server::State, "set", WHY)
            .on(Keys::State("followup:*"), Access::Write)
            .args("{key} id PX 1000"),
        Use::new(Server::State, "mget", WHY)
            .on(Keys::State("followup:*"), Access::Read)
            .args("{key}"),
        Use::new(Server::State, "del", WHY)
            .on(Keys::State("followup:*"), Access::Write)
            .args("{key}"),
        Use::new(Server::State, "set", "signed links: acknowledge")
            .on(Keys::State("ack:*"), Access::Write)
            .args("{key} at PX 1000"),
    ]
}
