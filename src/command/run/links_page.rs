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

/// Does what `claim` says (the link's `token`); returns what was done, in words.
pub async fn act(
    mut conn: Conn,
    prefix: &str,
    claim: &Claim,
    token: &str,
) -> redis::RedisResult<String> {
    let key = crate::event::printable(&claim.key_bytes()).into_owned();
    match claim.act {
        Act::Ack => {
            let ms = (claim.exp - clock::now_ms()).max(1_000) + 60_000;
            crate::store::followups::acknowledge(&mut conn, prefix, &claim.id, ms).await?;
            Ok(format!(
                "Acknowledged: the alert of rule {} for key {key} will not be escalated.",
                claim.rule
            ))
        }
        Act::Silence => {
            let now = Utc::now();
            let until = now + chrono::Duration::from_std(SILENCE_FOR).unwrap_or_default();
            let s = crate::engine::silences::Silence {
                id: silence_id(token),
                rule: claim.rule.clone(),
                pattern: Some(literal_pattern(&claim.key_bytes())),
                // The exact bytes: a key that is not UTF-8 has no pattern of its own.
                key: Some(claim.key.clone()),
                until,
                comment: "silenced from a signed link".into(),
                created: now,
                by: "link".into(),
            };
            if !crate::engine::silences::add_once(&mut conn, prefix, &s).await? {
                return Ok(format!(
                    "Already silenced from this link: rule {} for key {key} (silence {}).",
                    claim.rule, s.id
                ));
            }
            Ok(format!(
                "Silenced: rule {} for key {key} until {} (silence {}).",
                claim.rule,
                crate::firing::rfc3339(until),
                s.id
            ))
        }
    }
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
