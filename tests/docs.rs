//! The documentation stays true to the binary and to itself: the example rules in `rules/`
//! (English and Chinese) pass `check`; both READMEs name every rule field and channel type of the
//! rule reference (`docs/rules.md`), and the Chinese one every command the English one shows.

mod common;

use std::path::PathBuf;

use common::run_keywatch;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(name: &str) -> String {
    std::fs::read_to_string(repo().join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
}

#[test]
fn the_example_rules_pass_check() {
    let rules = repo().join("rules");
    let out = run_keywatch(["check", "-r", rules.to_str().unwrap()], &[]);
    assert!(
        out.status.success(),
        "keywatch check -r rules/ failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let explain = run_keywatch(
        [
            "explain",
            "stock_hold:sku-1001:order-42",
            "-r",
            rules.to_str().unwrap(),
        ],
        &[],
    );
    let text = String::from_utf8_lossy(&explain.stdout);
    assert!(explain.status.success(), "{text}");
    assert!(
        text.contains("订单 order-42 预占的商品 sku-1001 已超时未释放"),
        "the Chinese example renders its message:\n{text}"
    );
}

/// The first column of the table rows of the section `heading` in `doc` (`| `name` | ... |`).
fn table_names(doc: &str, heading: &str) -> Vec<String> {
    let start = doc
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?}"));
    doc[start..]
        .lines()
        .skip(1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| l.split('|').nth(1))
        .filter_map(|cell| cell.trim().strip_prefix('`'))
        .map(|cell| cell.split('`').next().unwrap().to_string())
        .collect()
}

/// Whether `text` has `name` in code: a backtick, the name, then no more of a name
/// (`` `warn_before: 7d` `` names `warn_before`, `` `oncall` `` does not name `on`).
fn names(text: &str, name: &str) -> bool {
    text.match_indices(&format!("`{name}")).any(|(i, m)| {
        !text[i + m.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
    })
}

#[test]
fn both_readmes_name_every_rule_field_channel_type_and_command() {
    let reference = read("docs/rules.md");
    let en = read("README.md");
    let zh = read("README.zh-CN.md");
    let fields = table_names(&reference, "## Rule fields");
    let types = table_names(&reference, "## Channels");
    assert!(
        fields.len() >= 10 && types.len() >= 6,
        "{fields:?} {types:?}"
    );
    for name in fields.iter().chain(&types) {
        assert!(names(&en, name), "README.md does not name `{name}`");
        assert!(names(&zh, name), "README.zh-CN.md does not name `{name}`");
    }
    for command in [
        "keywatch run",
        "keywatch check",
        "keywatch explain",
        "keywatch send-test",
        "keywatch demo",
        "keywatch completions",
        "cargo run --release -- demo",
        "./.ci/run",
        "cargo test",
    ] {
        if en.contains(command) {
            assert!(zh.contains(command), "README.zh-CN.md lacks `{command}`");
        }
    }
}
