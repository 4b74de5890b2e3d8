//! Whether a stored job is what the rules in force say for its key: keywatch's state is not a
//! way in (docs/reliability.md#keywatchs-state-is-not-a-way-in). Asked by every attempt
//! ([`super::ActionContext::run`]) and by a digest for each of its notifications.

use crate::config::Rule;
use crate::firing::Firing;

/// Why `f`, as stored, is not a firing of `rule` as it stands, if it is not: keywatch's state is
/// not a way in (docs/reliability.md#keywatchs-state-is-not-a-way-in). The event must be one the
/// rule fires on, its key (and field) must match the rule's pattern, and the captures stored with
/// it must be the ones the pattern takes from the key now: a job written into the queue by hand
/// with made-up captures, or a real one whose rule's pattern changed since, does not run.
pub fn refused(rule: &Rule, f: &Firing) -> Option<String> {
    if !rule.fires_on(f.kind, f.db) {
        return Some(format!(
            "rule `{}` does not fire on `{}` events in database {}",
            rule.name,
            f.kind.as_str(),
            f.db
        ));
    }
    if f.apart.is_some() {
        // A long key's firing as stored holds cut views: its captures are taken again from the
        // exact key when an attempt reads it back (`ActionContext::whole`). A digest lists it
        // from its cut view (docs/reliability.md#bounded-whatever-the-key).
        return None;
    }
    // Slices of the key, not copies (docs/reliability.md#bounded-whatever-the-key).
    let Some(values) = rule.captures_in(&f.key, f.field.as_deref()) else {
        return Some(format!(
            "the key {} does not match the pattern of rule `{}`",
            crate::event::printable(&f.key),
            rule.name
        ));
    };
    let names = rule.capture_names();
    let same = f.captures.len() == names.len()
        && f.captures
            .iter()
            .zip(names.iter().zip(&values))
            .all(|(c, (n, v))| c.name == *n && c.value == *v);
    if !same {
        let shown = |pairs: Vec<(&str, &[u8])>| {
            pairs
                .into_iter()
                .map(|(n, v)| format!("{n}={}", crate::event::printable(v)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Some(format!(
            "its captures ({}) are not the ones the pattern of rule `{}` takes from its key ({})",
            shown(
                f.captures
                    .iter()
                    .map(|c| (c.name.as_str(), &c.value[..]))
                    .collect()
            ),
            rule.name,
            shown(
                names
                    .iter()
                    .map(String::as_str)
                    .zip(values.iter().map(|v| &v[..]))
                    .collect()
            ),
        ));
    }
    None
}
