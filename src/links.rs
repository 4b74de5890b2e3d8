//! Signed links: acknowledge an alert (its escalation stops) or silence its rule and key for an
//! hour, from a chat message. DingTalk, Feishu and WeCom group robots cannot receive button
//! callbacks, so a link is the way to act from chat.
//!
//! A token names what it does and to which event (its id), and when it expires (with the
//! event's escalation): `base64url(JSON claim) "." base64url(HMAC-SHA256(secret, first part))`.
//! It never carries the key, only its SHA-256, so a link is as long for a key of 16 MB as for
//! one of 16 bytes (docs/reliability.md#bounded-whatever-the-key). The secret never leaves
//! keywatch; a token that does not verify, or has expired, is refused (403). Chat apps prefetch
//! links, so `GET /l/{token}` only shows what the button would do; the button's `POST` acts,
//! once (`crate::store::links`).

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};

use crate::config::followups::LinksSettings;
use crate::firing::Firing;

/// How long a silence from a link lasts.
pub const SILENCE_FOR: std::time::Duration = std::time::Duration::from_secs(3600);

/// What a link does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Act {
    /// Stops the escalation of the event.
    Ack,
    /// Silences the event's rule for its key, for an hour.
    Silence,
}

/// What a token says: the action, the event, and when the link expires.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub act: Act,
    /// The event's id (docs/rules.md#event-json).
    pub id: String,
    pub rule: String,
    /// The key's SHA-256, hex ([`crate::long_key::sha256_hex`]): what a silence from the link
    /// names the key by.
    pub sha256: String,
    pub db: u32,
    /// Unix ms after which the link is refused.
    pub exp: i64,
}

impl Claim {
    /// What the button does, in words, for the page; `key`: the key as history shows it, when
    /// it still does.
    pub fn describe(&self, key: Option<&str>) -> String {
        let key = match key {
            Some(k) => crate::event::printable(k.as_bytes()).into_owned(),
            None => format!("sha256 {}", &self.sha256[..self.sha256.len().min(12)]),
        };
        match self.act {
            Act::Ack => format!(
                "Acknowledge the alert of rule {} for key {key}: its escalation will not be sent.",
                self.rule
            ),
            Act::Silence => format!(
                "Silence rule {} for key {key} for one hour: its alerts are counted, not sent.",
                self.rule
            ),
        }
    }
}

/// Why a token is refused; each is a 403 (the page does not say which, to a guesser).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    #[error("the link is malformed")]
    Malformed,
    #[error("the link's signature does not match")]
    Forged,
    #[error("the link has expired")]
    Expired,
}

fn mac(secret: &[u8]) -> Hmac<sha2::Sha256> {
    <Hmac<sha2::Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes keys of any length")
}

/// The token of `claim`, signed with `secret`.
pub fn sign(secret: &[u8], claim: &Claim) -> String {
    let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claim).unwrap_or_default());
    let mut m = mac(secret);
    m.update(body.as_bytes());
    let sig = URL_SAFE_NO_PAD.encode(m.finalize().into_bytes());
    format!("{body}.{sig}")
}

/// The claim of `token` if `secret` signed it and it has not expired at `now_ms`.
pub fn verify(secret: &[u8], token: &str, now_ms: i64) -> Result<Claim, Refused> {
    let (body, sig) = token.split_once('.').ok_or(Refused::Malformed)?;
    let sig = URL_SAFE_NO_PAD
        .decode(sig)
        .map_err(|_| Refused::Malformed)?;
    let mut m = mac(secret);
    m.update(body.as_bytes());
    // Constant time: a guesser learns nothing from how long a refusal takes.
    m.verify_slice(&sig).map_err(|_| Refused::Forged)?;
    let json = URL_SAFE_NO_PAD
        .decode(body)
        .map_err(|_| Refused::Malformed)?;
    let claim: Claim = serde_json::from_slice(&json).map_err(|_| Refused::Malformed)?;
    if now_ms > claim.exp {
        return Err(Refused::Expired);
    }
    Ok(claim)
}

/// The two links of a firing whose rule escalates after `wait`: (label, URL), acknowledge first.
/// `f` is the firing with its exact key (not a cut view: the key's hash names it).
pub fn for_firing(
    links: &LinksSettings,
    f: &Firing,
    wait: std::time::Duration,
) -> Vec<(String, String)> {
    let exp = f.observed_at.timestamp_millis() + wait.as_millis() as i64;
    let sha256 = crate::long_key::sha256_hex(&f.key);
    [(Act::Ack, "Acknowledge"), (Act::Silence, "Silence 1h")]
        .into_iter()
        .map(|(act, label)| {
            let claim = Claim {
                act,
                id: f.id.clone(),
                rule: f.rule.clone(),
                sha256: sha256.clone(),
                db: f.db,
                exp,
            };
            let token = sign(links.secret.expose().as_bytes(), &claim);
            (label.to_string(), format!("{}/l/{token}", links.base_url))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(exp: i64) -> Claim {
        Claim {
            act: Act::Ack,
            id: "abc".into(),
            rule: "r".into(),
            sha256: crate::long_key::sha256_hex(b"key"),
            db: 0,
            exp,
        }
    }

    /// A link refers to the event and names the key by its hash: as long for a key of 16 MB as
    /// for a short one.
    #[test]
    fn a_link_s_length_does_not_depend_on_the_key() {
        let settings = LinksSettings {
            base_url: "https://kw.example".into(),
            secret: crate::yaml::Secret::new("0123456789abcdef"),
        };
        let short = crate::firing::expiry("r", "k:1", "2026-01-01T00:00:00Z");
        let long = crate::firing::expiry("r", &"k".repeat(16 << 20), "2026-01-01T00:00:00Z");
        let wait = std::time::Duration::from_secs(3600);
        let (a, b) = (
            for_firing(&settings, &short, wait),
            for_firing(&settings, &long, wait),
        );
        for ((_, s), (_, l)) in a.iter().zip(&b) {
            assert_eq!(s.len(), l.len(), "{s} / {l}");
            assert!(l.len() < 400, "{}", l.len());
        }
    }

    #[test]
    fn a_signed_token_verifies_and_nothing_else_does() {
        let t = sign(b"0123456789abcdef", &claim(2_000));
        assert_eq!(verify(b"0123456789abcdef", &t, 1_000), Ok(claim(2_000)));
        assert_eq!(verify(b"another secret!!", &t, 1_000), Err(Refused::Forged));
        assert_eq!(
            verify(b"0123456789abcdef", &t, 3_000),
            Err(Refused::Expired)
        );
        // A claim changed after signing (a later expiry, say) no longer matches.
        let (_, sig) = t.split_once('.').unwrap();
        let forged = format!(
            "{}.{sig}",
            URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claim(9_999_999)).unwrap())
        );
        assert_eq!(
            verify(b"0123456789abcdef", &forged, 1_000),
            Err(Refused::Forged)
        );
        assert_eq!(
            verify(b"0123456789abcdef", "nonsense", 0),
            Err(Refused::Malformed)
        );
        assert!(!t.contains("0123456789abcdef"));
    }
}
