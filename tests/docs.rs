//! The documentation stays true to the binary: the example rules in `rules/` (English and
//! Chinese) pass `check`, and the Chinese README covers every rule field, channel type and
//! command that the English one does.

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

/// The first column of the table rows of `section` in `readme` (`| `name` | ... |`).
fn table_names(readme: &str, heading: &str) -> Vec<String> {
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?}"));
    readme[start..]
        .lines()
        .skip(1)
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| l.split('|').nth(1))
        .filter_map(|cell| cell.trim().strip_prefix('`'))
        .map(|cell| cell.split('`').next().unwrap().to_string())
        .collect()
}

#[test]
fn the_chinese_readme_covers_what_the_english_one_does() {
    let en = read("README.md");
    let zh = read("README.zh-CN.md");
    let fields = table_names(&en, "### Rule fields");
    let types = table_names(&en, "### Channels");
    assert!(
        fields.len() >= 10 && types.len() >= 6,
        "{fields:?} {types:?}"
    );
    let zh_fields = table_names(&zh, "### 规则字段");
    let zh_types = table_names(&zh, "### 渠道");
    assert_eq!(zh_fields, fields, "rule fields differ between the READMEs");
    assert_eq!(zh_types, types, "channel types differ between the READMEs");
    for command in [
        "keywatch run",
        "keywatch check",
        "keywatch explain",
        "keywatch send-test",
        "keywatch demo",
        "keywatch completions",
        "cargo run --release -- demo",
        "cargo test",
    ] {
        if en.contains(command) {
            assert!(zh.contains(command), "README.zh-CN.md lacks `{command}`");
        }
    }
}
