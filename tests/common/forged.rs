//! Writing keywatch's state by hand, as an application whose Redis user can write `keywatch:*`
//! could (docs/redis.md#keep-applications-out-of-keywatchs-state): the drills of "keywatch's
//! state is not a way in" forge entries through here.
//!
//! The one place in the tests that knows how the queue stores a job (`src/store/queue.rs`,
//! `src/firing.rs`): a sorted set `{prefix}queue` (job id → due, ms) and a hash
//! `{prefix}queue:jobs` (job id → the job's JSON). A change of that format changes this file.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use redis::ConnectionLike;

/// Puts a job into the queue under `prefix`, due now: `action` (`"exec"`, `"reload"`,
/// `"cleanup"`) of an `expired` event of `rule` on `key` in database 0, carrying `captures`
/// (name, value) as written, whatever the rule's pattern would take from the key. Returns the
/// job's id; a running keywatch takes it within its next look at the queue.
pub fn forge_job(
    conn: &mut impl ConnectionLike,
    prefix: &str,
    rule: &str,
    key: &[u8],
    captures: &[(&str, &[u8])],
    action: &str,
) -> String {
    let event_id = format!("{:032x}", fastrand::u128(..));
    let job_id = format!("{event_id}:{action}");
    let now = chrono::Utc::now();
    let firing = serde_json::json!({
        "id": event_id,
        "rule": rule,
        "kind": "expired",
        "db": 0,
        "key": STANDARD.encode(key),
        "captures": captures
            .iter()
            .map(|(name, value)| serde_json::json!({"name": name, "value": STANDARD.encode(value)}))
            .collect::<Vec<_>>(),
        "detail": null,
        "deadline": null,
        "observed_at": now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        "ttl_ms": null,
        "recovered": false,
        "source": "forged",
    });
    let job = serde_json::json!({
        "firing": firing,
        "action": {"action": action},
        "attempt": 0,
        "failing_since": null,
    });
    let () = redis::pipe()
        .cmd("HSET")
        .arg(format!("{prefix}queue:jobs"))
        .arg(&job_id)
        .arg(job.to_string())
        .ignore()
        .cmd("ZADD")
        .arg(format!("{prefix}queue"))
        .arg(now.timestamp_millis())
        .arg(&job_id)
        .ignore()
        .query(conn)
        .expect("write the forged job");
    job_id
}
