//! The least-privilege ACL lines the docs print, derived from the commands the code
//! declares (docs/redis.md#least-privilege-acl).

use crate::keyspace::commands::{Access, Keys, PubSub, Server, Use, When};

use super::permissions::{REGISTRY, needs};
use crate::config::Config;
use crate::source::ledger::Ledger;

/// The documented least-privilege line for `prefix`: every command some setup sends, but for
/// those only some setups need ([`When::in_base_acl`]), which the docs name one by one.
pub fn base_acl_line(prefix: &str) -> String {
    let base: Vec<&Use> = REGISTRY
        .iter()
        .flat_map(|d| d.uses)
        .filter(|u| u.when.in_base_acl())
        .collect();
    let mut words = vec!["ACL SETUSER keywatch reset on >PASSWORD".to_string()];
    if base.iter().any(|u| matches!(u.keys, Keys::State(_))) {
        words.push(format!("~{prefix}*"));
    }
    let reads = |k: Keys| !matches!(k, Keys::None | Keys::State(_));
    if base.iter().any(|u| reads(u.keys)) {
        words.push(format!("{}*", Access::Read.selector()));
    }
    words.push("resetchannels".into());
    for ch in [PubSub::Keyevent, PubSub::Marker] {
        if base.iter().any(|u| u.channel == Some(ch)) {
            words.push(match ch {
                PubSub::Keyevent => "&__keyevent@*__:*".to_string(),
                PubSub::Marker => format!("&{}", Ledger::marker_channel(prefix)),
            });
        }
    }
    for c in base_commands() {
        words.push(format!("+{c}"));
    }
    words.join(" ")
}

/// The sentinels' ACL line of the README (Sentinel): their default user, which keywatch logs in
/// as, with the channels and commands declared for [`Server::Sentinel`].
pub fn sentinel_acl_line() -> String {
    let mut words = vec!["ACL SETUSER default on >PASSWORD resetchannels".to_string()];
    words.extend(
        crate::source::sentinel::CHANNELS
            .iter()
            .map(|c| format!("&{c}")),
    );
    words.extend(["-@all".to_string(), "+auth".to_string()]);
    for u in REGISTRY.iter().flat_map(|d| d.uses) {
        let grant = format!("+{}", u.command);
        if u.server == Server::Sentinel && !words.contains(&grant) {
            words.push(grant);
        }
    }
    words.join(" ")
}

pub(super) fn base_commands() -> Vec<&'static str> {
    let mut out: Vec<&str> = Vec::new();
    for u in REGISTRY.iter().flat_map(|d| d.uses) {
        if u.when.in_base_acl() && !out.contains(&u.command) {
            out.push(u.command);
        }
    }
    out
}

/// The commands only `hexpired` rules send. They go on an ACL line of their own: a server
/// without hash-field expiry refuses a line that names `hpexpiretime`.
pub(super) fn field_commands() -> Vec<&'static str> {
    let base = base_commands();
    let mut out: Vec<&str> = Vec::new();
    for u in REGISTRY.iter().flat_map(|d| d.uses) {
        if u.when == When::Fields && !base.contains(&u.command) && !out.contains(&u.command) {
            out.push(u.command);
        }
    }
    out
}

/// What `config`'s `hexpired` rules add: `None` without such rules.
pub fn fields_acl_line(config: &Config) -> Option<String> {
    config.watches_fields().then(|| {
        let grants: Vec<String> = field_commands().iter().map(|c| format!("+{c}")).collect();
        format!("ACL SETUSER keywatch {}", grants.join(" "))
    })
}

/// What `config`'s rules add to the base line: the commands the base leaves out (but those of
/// [`fields_acl_line`]), and write access to exactly what they delete. `None` when they add
/// nothing.
pub fn rules_acl_line(config: &Config) -> Option<String> {
    let base = base_commands();
    let fields = field_commands();
    let needs = needs(config);
    let commands = needs
        .iter()
        .filter(|n| !base.contains(&n.command.as_str()) && !fields.contains(&n.command.as_str()))
        .map(|n| format!("+{}", n.command));
    let keys = needs.iter().filter_map(|n| match &n.key {
        Some((glob, access)) if n.server == Server::Watched && *access != Access::Read => {
            Some(format!("{}{glob}", access.selector()))
        }
        _ => None,
    });
    let mut grants: Vec<String> = Vec::new();
    for g in commands.chain(keys) {
        if !grants.contains(&g) {
            grants.push(g);
        }
    }
    (!grants.is_empty()).then(|| format!("ACL SETUSER keywatch {}", grants.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_acl_lines_are_the_derived_ones() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let docs = std::fs::read_to_string(root.join("docs/redis.md")).unwrap();
        let start = docs.find("## Least-privilege ACL").unwrap();
        let section = &docs[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        let documented: Vec<&str> = section
            .lines()
            .filter(|l| l.starts_with("ACL SETUSER keywatch "))
            .collect();
        // A value of the right shape for each variable the example rules use; one with a
        // default in the file (the SMTP relay) keeps it.
        let env = |name: &str| match name {
            n if n.contains("REDIS") => Some("redis://127.0.0.1:6379".to_string()),
            n if n.starts_with("SMTP_") => None,
            "PAGERDUTY_ROUTING_KEY" => Some("0123456789abcdef0123456789abcdef".to_string()),
            "TELEGRAM_BOT_TOKEN" => Some("123456789:AAE-example_token_0123456789".to_string()),
            _ => Some("https://example.com/hook".to_string()),
        };
        let every_example = [root.join("rules"), root.join("extra-rules")];
        let rules = crate::config::load(&every_example, crate::config::Mode::Check, &env)
            .unwrap_or_else(|e| panic!("rules/, extra-rules/: {e:?}"))
            .config;
        assert_eq!(rules.state.prefix, "keywatch:");
        let derived = [
            base_acl_line(&rules.state.prefix),
            rules_acl_line(&rules).expect("the example rules delete something"),
            fields_acl_line(&rules).expect("an example rule watches hash fields"),
        ];
        assert_eq!(
            documented,
            derived,
            "docs/redis.md, section \"Least-privilege ACL\", should have these lines:\n{}\n",
            derived.join("\n")
        );
    }

    #[test]
    fn the_documented_sentinel_acl_line_is_the_derived_one() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let derived = sentinel_acl_line();
        for readme in ["README.md", "README.zh-CN.md"] {
            let text = std::fs::read_to_string(root.join(readme)).unwrap();
            let documented: Vec<&str> = text
                .lines()
                .filter(|l| l.starts_with("ACL SETUSER default "))
                .collect();
            assert_eq!(
                documented,
                [derived.as_str()],
                "{readme}, section Sentinel, should have this line:\n{derived}\n"
            );
        }
    }
}
