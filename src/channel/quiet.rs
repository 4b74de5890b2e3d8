//! A channel's `quiet` (docs/rules.md#quiet-hours), as written: the window is looked up by
//! `config` once every file is read (`config::quiet::check_channel`).

use crate::quiet_hours::Release;
use crate::yaml::Node;
use crate::yaml::decode::{Decoder, Spanned};
use crate::yaml::diagnostic::{Loc, did_you_mean};

/// A channel's `quiet`, before its window is looked up.
#[derive(Clone, Debug)]
pub struct ChannelQuietDraft {
    pub loc: Loc,
    pub during: Spanned<String>,
    /// `None`: not written, the channel's default.
    pub release: Option<Spanned<Release>>,
}

/// Window names are written like channel and rule names.
pub fn is_window_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
}

/// A channel's `quiet: { during: WINDOW, release: digest|each|count }`.
pub fn decode_channel_quiet(
    d: &mut Decoder<'_>,
    node: &Node,
    what: &str,
) -> Option<ChannelQuietDraft> {
    let what = format!("{what} `quiet`");
    let mut m = d.map(node, &what)?;
    let during = m.require(d, "during").and_then(|n| {
        d.name(
            n,
            &format!("{what} `during`"),
            is_window_name,
            "name a window of `quiet_hours`",
        )
    });
    // A bad `release` is reported, and the window is still looked up.
    let release = m.get("release").and_then(|n| {
        let t = d.text(n, &format!("{what} `release`"))?;
        let r = Release::parse(t.value.trim());
        if r.is_none() {
            let names = Release::ALL.map(Release::as_str);
            d.error(
                &t.loc,
                format!(
                    "{what} `release` must be `digest`, `each` or `count`, found `{}`{}",
                    t.value,
                    did_you_mean(t.value.trim(), names)
                ),
            );
        }
        Some(Spanned {
            value: r.unwrap_or_default(),
            loc: t.loc,
        })
    });
    m.finish(d, &["during", "release"], &|f| match f {
        "from" | "to" | "days" => {
            Some("a channel names a window of `quiet_hours` with `during`; its days and times are written there".into())
        }
        _ => None,
    });
    Some(ChannelQuietDraft {
        loc: node.loc.clone(),
        during: during?,
        release,
    })
}
