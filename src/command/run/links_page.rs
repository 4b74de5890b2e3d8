//! The pages of `/l/{token}`: what a signed link's button will do (`GET`, inert), and what it
//! did (`POST`): acknowledge an alert, or silence its rule for its key for an hour.

use chrono::Utc;

use crate::keyspace::{Conn, clock};
use crate::links::{Act, Claim, SILENCE_FOR};

use super::status_page::esc;

/// A small page: a heading, a sentence, and maybe the one button (a form that POSTs to the same
/// address, so a prefetching chat app never presses it).
pub fn page(title: &str, text: &str, button: Option<&str>) -> String {
    let form = button
        .map(|b| {
            format!(
                "<form method=\"post\"><button type=\"submit\">{}</button></form>",
                esc(b)
            )
        })
        .unwrap_or_default();
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta name=\"robots\" content=\"noindex\"><title>{t}</title><style>\
         body{{font:16px/1.5 system-ui,sans-serif;max-width:34rem;margin:3rem auto;padding:0 1rem;color:#1b1f24}}\
         h1{{font-size:1.3rem}}button{{font:inherit;padding:.6rem 1.2rem;border:0;border-radius:6px;\
         background:#cf222e;color:#fff;cursor:pointer}}</style></head>\
         <body><h1>{t}</h1><p>{x}</p>{form}</body></html>\n",
        t = esc(title),
        x = esc(text),
    )
}

/// The button's words.
pub fn button(act: Act) -> &'static str {
    match act {
        Act::Ack => "Acknowledge",
        Act::Silence => "Silence for 1 hour",
    }
}

/// The event's key as history keeps it (cut when long), for people, if history still has the
/// event of `claim`; and its exact bytes when they are the key the link names.
pub async fn key_of(
    conn: &mut Conn,
    prefix: &str,
    claim: &Claim,
) -> (Option<String>, Option<Vec<u8>>) {
    let Ok(Some(f)) = crate::store::history::firing(conn, prefix, &claim.id).await else {
        return (None, None);
    };
    if f.rule != claim.rule || f.db != claim.db {
        return (None, None);
    }
    let shown = crate::event::printable(&f.key).into_owned();
    let exact = (crate::long_key::sha256_hex(&f.key) == claim.sha256).then_some(f.key.to_vec());
    (Some(shown), exact)
}

/// Does what `claim` says (the link's `token`), once: a link used before (replayed, or after
/// `keywatch silence remove` took away the silence it made) does nothing again. Returns what
/// was done, in words.
pub async fn act(
    mut conn: Conn,
    prefix: &str,
    claim: &Claim,
    token: &str,
) -> redis::RedisResult<String> {
    let (shown, exact) = key_of(&mut conn, prefix, claim).await;
    let key = shown
        .clone()
        .unwrap_or_else(|| format!("sha256 {:.12}", claim.sha256));
    if !crate::store::links::take(&mut conn, prefix, token, claim.exp, clock::now_ms()).await? {
        return Ok(format!(
            "This link was already used: it acts once (rule {}, key {key}). `keywatch silence add` silences again.",
            claim.rule
        ));
    }
    let done = match claim.act {
        Act::Ack => {
            let ms = (claim.exp - clock::now_ms()).max(1_000) + 60_000;
            crate::store::followups::acknowledge(&mut conn, prefix, &claim.id, ms)
                .await
                .map(|()| {
                    format!(
                        "Acknowledged: the alert of rule {} for key {key} will not be escalated.",
                        claim.rule
                    )
                })
        }
        Act::Silence => {
            let now = Utc::now();
            let until = now + chrono::Duration::from_std(SILENCE_FOR).unwrap_or_default();
            use base64::Engine;
            let s = crate::engine::silences::Silence {
                id: silence_id(token),
                rule: claim.rule.clone(),
                // For people and for older versions, which read `key` or else the pattern: a
                // key history no longer has is spelled so that it matches no key.
                pattern: Some(match &exact {
                    Some(k) => literal_pattern(k),
                    None => literal_pattern(format!("<{key}>").as_bytes()),
                }),
                key: exact
                    .as_deref()
                    .map(|k| base64::engine::general_purpose::STANDARD.encode(k)),
                key_sha256: Some(claim.sha256.clone()),
                until,
                comment: "silenced from a signed link".into(),
                created: now,
                by: "link".into(),
            };
            crate::engine::silences::add(&mut conn, prefix, &s)
                .await
                .map(|()| {
                    format!(
                        "Silenced: rule {} for key {key} until {} (silence {}).",
                        claim.rule,
                        crate::firing::rfc3339(until),
                        s.id
                    )
                })
        }
    };
    if done.is_err() {
        // Not done: the link may be pressed again.
        let _ = crate::store::links::give_back(&mut conn, prefix, token).await;
    }
    done
}

/// The id of the silence a link makes, the same for every use of the link: replaying it (a chat
/// app's retries, a script) makes one silence, not one per request.
fn silence_id(token: &str) -> String {
    use sha2::Digest;
    hex::encode(&sha2::Sha256::digest(token.as_bytes())[..4])
}

/// A pattern (docs/rules.md#patterns) that matches exactly `key`: `\\ { } *` escaped. A key that is not UTF-8
/// cannot be written as one: this spells it for people, and the silence's `key` holds the bytes.
fn literal_pattern(key: &[u8]) -> String {
    let mut out = String::new();
    for c in String::from_utf8_lossy(key).chars() {
        if matches!(c, '\\' | '{' | '}' | '*') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_key_becomes_the_pattern_of_itself_alone() {
        let p = super::literal_pattern(b"lock:{a}*\\b");
        let pattern = crate::pattern::Pattern::parse(&p).unwrap();
        assert!(pattern.is_match(b"lock:{a}*\\b"));
        assert!(!pattern.is_match(b"lock:{a}xx\\b"));
    }
}
