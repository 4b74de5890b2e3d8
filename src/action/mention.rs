//! `notify.mention`: a rule's own mentions, rendered per event (`{{ detail.mobile }}`) and
//! checked before any channel sees them.
//!
//! A rendered value comes from data (a detail, a key): it may be empty, a name, or `all`. Each
//! one must look like what it claims to be (a mobile number, a user id) or it is dropped with a
//! warning; nothing rendered can ever mention everyone, only the rule's literal `all: true` can.

use crate::channel::chat::Mention;
use crate::config::RuleMention;
use crate::event::printable;
use crate::internal_events::MentionDropped;
use crate::template::{Context, TemplateSet};

/// The mentions of `m` for the event of `ctx`; values that render badly or look wrong are left
/// out, each with a warning naming the rule.
pub fn render(templates: &TemplateSet, m: &RuleMention, rule: &str, ctx: &Context) -> Mention {
    let mut out = Mention {
        all: m.all,
        ..Mention::default()
    };
    for (ids, list, plausible, what) in [
        (
            &m.mobiles,
            &mut out.mobiles,
            plausible_mobile as fn(&str) -> bool,
            "mobile",
        ),
        (&m.user_ids, &mut out.user_ids, plausible_user_id, "user id"),
    ] {
        for &id in ids {
            match templates.render_text(id, ctx) {
                Ok(v) => {
                    let v = v.trim();
                    if v.is_empty() {
                        MentionDropped {
                            rule,
                            kind: what,
                            value: "",
                            why: "it rendered empty",
                        }
                        .emit();
                    } else if !plausible(v) {
                        MentionDropped {
                            rule,
                            kind: what,
                            value: &printable(v.as_bytes()),
                            why: "it is not plausible",
                        }
                        .emit();
                    } else if !list.iter().any(|x| x == v) {
                        list.push(v.to_string());
                    }
                }
                Err(e) => MentionDropped {
                    rule,
                    kind: what,
                    value: "",
                    why: &format!("it cannot be rendered: {}", e.message),
                }
                .emit(),
            }
        }
    }
    out
}

/// A mobile number as the chat robots take it: digits, optionally `+` and a country code with
/// one `-` (DingTalk writes overseas numbers `+852-12345678`); 5 to 20 digits in all.
pub fn plausible_mobile(v: &str) -> bool {
    let rest = v.strip_prefix('+').unwrap_or(v);
    let digits = rest.chars().filter(char::is_ascii_digit).count();
    rest.starts_with(|c: char| c.is_ascii_digit())
        && rest.chars().all(|c| c.is_ascii_digit() || c == '-')
        && rest.matches('-').count() <= 1
        && !rest.ends_with('-')
        && (5..=20).contains(&digits)
}

/// A user id (DingTalk userid, Feishu open_id `ou_…`, WeCom userid, Slack `U…`): letters,
/// digits, `_`, `-`, `.`, at most 64; never one of the words that mean "everyone".
pub fn plausible_user_id(v: &str) -> bool {
    const EVERYONE: &[&str] = &["all", "here", "channel", "everyone"];
    !v.is_empty()
        && v.len() <= 64
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        && !EVERYONE.iter().any(|w| v.eq_ignore_ascii_case(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mobiles_are_digits_with_an_optional_country_code() {
        for ok in ["13800000000", "+852-12345678", "+8613800000000"] {
            assert!(plausible_mobile(ok), "{ok}");
        }
        for bad in [
            "",
            "@all",
            "all",
            "138 0000",
            "1380000000a",
            "+",
            "12-34-56789",
            "1234",
            "138-",
        ] {
            assert!(!plausible_mobile(bad), "{bad}");
        }
    }

    #[test]
    fn user_ids_never_mean_everyone() {
        for ok in [
            "ou_7d8a6e6df7621556ce0d21922b676706",
            "U012AB3CD",
            "zhang.san",
            "wang-qing",
        ] {
            assert!(plausible_user_id(ok), "{ok}");
        }
        for bad in [
            "all",
            "ALL",
            "@all",
            "here",
            "<!channel>",
            "a b",
            "x\"y",
            "",
            "everyone",
        ] {
            assert!(!plausible_user_id(bad), "{bad}");
        }
        assert!(!plausible_user_id(&"a".repeat(65)));
    }
}
