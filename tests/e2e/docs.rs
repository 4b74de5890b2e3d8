//! The documentation stays true to the binary and to itself: the example rules in `rules/`
//! (English and Chinese) pass `check`; both READMEs name every rule field and channel type of the
//! rule reference (`docs/rules.md`), and the Chinese one every command the English one shows; every
//! relative link of the READMEs and `docs/` leads to a file and heading that exist; the commands
//! page shows every command and option of the CLI. (The internal events and metrics tables of
//! `docs/operations.md` are checked by unit tests beside the code: `internal_events::tests`,
//! `metrics::tests`.)

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
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
    // `rules/` runs as shipped: no variable to set, so not one warning.
    let out = run_keywatch(["check", "-r", rules.to_str().unwrap()], &[]);
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "keywatch check -r rules/ failed or warned:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each of `extra-rules/` beside them, with what it needs only warned about.
    for file in std::fs::read_dir(repo().join("extra-rules")).unwrap() {
        let file = file.unwrap().path();
        if file.to_str().unwrap().ends_with(".test.yaml") {
            continue;
        }
        let out = run_keywatch(
            [
                "check",
                "-r",
                rules.to_str().unwrap(),
                "-r",
                file.to_str().unwrap(),
            ],
            &[],
        );
        assert!(
            out.status.success(),
            "keywatch check -r rules/ -r {} failed:\n{}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
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

/// The first fenced block after `marker` in `doc`, without its fences.
fn block_after(doc: &str, marker: &str) -> String {
    let start = doc.find(marker).unwrap_or_else(|| panic!("no {marker:?}"));
    let rest = &doc[start..];
    let open = rest.find("```").unwrap();
    let body = &rest[open..];
    let body = &body[body.find('\n').unwrap() + 1..];
    body[..body.find("```").unwrap()].to_string()
}

/// README's first rule passes the test README shows beside it, and its local run (`check`,
/// `explain` on the shipped `rules/`) answers without a warning: no variable to set first.
#[test]
fn the_readmes_first_rule_passes_its_test_and_the_local_run_needs_no_environment() {
    let readme = read("README.md");
    let dir = tempfile::tempdir().unwrap();
    let rule = block_after(&readme, "## A first rule");
    let test = block_after(&readme, "A test gives events and lists every action");
    assert!(test.starts_with("# first-rule.test.yaml\n"), "{test}");
    std::fs::write(dir.path().join("first-rule.yaml"), rule).unwrap();
    let test_file = dir.path().join("first-rule.test.yaml");
    std::fs::write(&test_file, test).unwrap();
    let out = run_keywatch(["test", test_file.to_str().unwrap()], &[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The flags README has the reader set are every flag `check` says the rules need.
    let local = block_after(&readme, "### Run keywatch on a local Redis");
    let set = local
        .lines()
        .find_map(|l| l.strip_prefix("redis-cli config set notify-keyspace-events "))
        .expect("README sets the notification flags");
    let flags = set.split_whitespace().next().unwrap();
    let rules = repo().join("rules");
    let check = run_keywatch(["check", "-r", rules.to_str().unwrap()], &[]);
    let check = String::from_utf8_lossy(&check.stdout);
    let needed = check
        .split("notify-keyspace-events with at least `")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .unwrap_or_else(|| panic!("{check}"));
    for flag in needed.chars() {
        assert!(
            flags.contains(flag),
            "README sets `{flags}`, the rules need `{needed}`"
        );
    }
    for args in [
        vec!["check", "-r", rules.to_str().unwrap()],
        vec!["explain", "order_lock:42", "-r", rules.to_str().unwrap()],
    ] {
        let out = run_keywatch(&args, &[]);
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "keywatch {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
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
    assert!(fields.len() >= 10, "{fields:?}");
    let registered: Vec<&str> = keywatch::channel::KINDS.iter().map(|k| k.name).collect();
    let mut documented: Vec<&str> = types.iter().map(String::as_str).collect();
    let mut sorted = registered.clone();
    sorted.sort_unstable();
    documented.sort_unstable();
    assert_eq!(
        documented, sorted,
        "docs/rules.md's channel table and the integrations registered in src/channel/mod.rs differ"
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

/// GitHub's anchor for a heading: lowercase, punctuation but `-` and `_` dropped, spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of the headings of a Markdown file, outside code blocks; a repeated heading gets
/// `-1`, `-2`, … as on GitHub.
fn anchors(markdown: &str) -> Vec<String> {
    let mut bases: Vec<String> = Vec::new();
    let mut anchors = Vec::new();
    for line in prose_lines(markdown) {
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        let base = slug(heading.trim_start_matches('#'));
        let repeats = bases.iter().filter(|b| **b == base).count();
        anchors.push(match repeats {
            0 => base.clone(),
            n => format!("{base}-{n}"),
        });
        bases.push(base);
    }
    anchors
}

/// The lines of a Markdown file outside fenced code blocks.
fn prose_lines(markdown: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    markdown.lines().filter(move |l| {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The targets of the inline links `[text](target)` of a Markdown file, outside code.
fn link_targets(markdown: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose_lines(markdown) {
        // Code spans hold `[...]` and `(...)` that are not links.
        let text: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            if let Some(end) = rest.find(')') {
                targets.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    targets
}

#[test]
fn every_relative_link_points_at_a_file_and_heading_that_exist() {
    let mut documents = vec![repo().join("README.md"), repo().join("README.zh-CN.md")];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(repo().join("docs"))
        .expect("read docs/")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    pages.sort();
    assert!(pages.len() >= 5, "docs/ holds the manual: {pages:?}");
    documents.extend(pages);
    let mut broken = Vec::new();
    for document in &documents {
        let text = std::fs::read_to_string(document).unwrap();
        let name = document.strip_prefix(repo()).unwrap().display().to_string();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                document.clone()
            } else {
                document.parent().unwrap().join(path)
            };
            if !file.exists() {
                broken.push(format!("{name}: ({target}): no file {}", file.display()));
                continue;
            }
            if anchor.is_empty() {
                continue;
            }
            let headings = anchors(&std::fs::read_to_string(&file).unwrap_or_default());
            if !headings.iter().any(|h| h == anchor) {
                broken.push(format!(
                    "{name}: ({target}): no heading #{anchor} in {path}; there are {headings:?}"
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every `.rs` file under `tests/` that the manual, the READMEs, the changelog's unreleased part,
/// `.ci/run` or the code names by its path (`tests/e2e/alertmanager.rs`) exists: suites moved into
/// `tests/e2e/` once, and the old paths lingered in comments and prose. Released notes keep the
/// paths of their time.
#[test]
fn every_test_file_named_by_its_path_exists() {
    fn files(dir: &std::path::Path, ext: &str, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, ext, out);
            } else if path.extension().is_some_and(|e| e == ext) {
                out.push(path);
            }
        }
    }
    let mut sources = vec![
        repo().join("README.md"),
        repo().join("README.zh-CN.md"),
        repo().join(".ci/run"),
    ];
    files(&repo().join("docs"), "md", &mut sources);
    for dir in ["src", "tests", "benches", "examples"] {
        if repo().join(dir).is_dir() {
            files(&repo().join(dir), "rs", &mut sources);
        }
    }
    let changelog = read("CHANGELOG.md");
    let unreleased = changelog
        .split("\n## [")
        .nth(1)
        .expect("an [Unreleased] section");
    let mut texts: Vec<(String, String)> = sources
        .iter()
        .map(|p| {
            let name = p.strip_prefix(repo()).unwrap().display().to_string();
            (name, std::fs::read_to_string(p).unwrap())
        })
        .collect();
    texts.push(("CHANGELOG.md [Unreleased]".into(), unreleased.to_string()));
    let mut stale = Vec::new();
    for (name, text) in &texts {
        for (i, _) in text.match_indices("tests/") {
            // A path of its own, not the end of another (`fuzz/tests/x.rs`).
            let before = text[..i].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '/' || c == '_') {
                continue;
            }
            let path: String = text[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '/' | '_' | '-' | '.'))
                .collect();
            let path = path.trim_end_matches('.');
            // `tests/NAME.rs`: a placeholder, not a file.
            let placeholder = path.chars().any(|c| c.is_ascii_uppercase());
            if path.ends_with(".rs") && !placeholder && !repo().join(path).is_file() {
                stale.push(format!("{name}: {path}"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "paths of test files that do not exist:\n{}",
        stale.join("\n")
    );
}

/// What `keywatch PATH --help` lists: the subcommands (without `help`) and the options, each
/// as its spellings (`--rules`, `-r`), without `--help` and `--version`.
fn cli_help(path: &[&str]) -> (Vec<String>, Vec<Vec<String>>) {
    let mut args = path.to_vec();
    args.push("--help");
    let out = run_keywatch(&args, &[]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "keywatch {args:?}: {text}");
    let mut section = "";
    let (mut commands, mut options) = (Vec::new(), Vec::new());
    for line in text.lines() {
        if !line.starts_with(' ') && line.ends_with(':') {
            section = line;
            continue;
        }
        let entry = line.trim_start();
        if entry.is_empty() || !line.starts_with("  ") {
            continue;
        }
        match section {
            "Commands:" => {
                let name = entry.split_whitespace().next().unwrap();
                if name != "help" {
                    commands.push(name.to_string());
                }
            }
            "Options:" => {
                let spellings: Vec<String> = entry
                    .split_whitespace()
                    .map(|w| w.trim_end_matches(','))
                    .take_while(|w| w.starts_with('-'))
                    .map(str::to_string)
                    .collect();
                // In the long form (a command with a long description) an option's help is on
                // lines of its own.
                if !spellings.is_empty()
                    && !spellings.iter().any(|s| s == "--help" || s == "--version")
                {
                    options.push(spellings);
                }
            }
            _ => {}
        }
    }
    (commands, options)
}

/// The flags written in `text`: `--name` and `-x` words (`[-r PATH]...`, `ID...|--all`).
fn flags_in(text: &str) -> BTreeSet<String> {
    text.split(|c: char| c.is_whitespace() || "[]|".contains(c))
        .filter(|w| {
            w.strip_prefix("--").map_or_else(
                || w.len() == 2 && w.starts_with('-') && w[1..].chars().all(char::is_alphabetic),
                |name| !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '-'),
            )
        })
        .map(str::to_string)
        .collect()
}

/// docs/commands.md names every command of `keywatch --help`, with every option and
/// subcommand of it, and no option it does not have; and the options every command takes.
#[test]
fn the_commands_page_shows_every_command_and_option_of_the_cli() {
    let page = read("docs/commands.md");
    let block = page.split("```").nth(1).expect("the synopsis block");
    // A line starting with `keywatch NAME` and the indented lines after it.
    let mut synopsis: BTreeMap<String, String> = BTreeMap::new();
    let mut current = String::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix("keywatch ") {
            let name = rest.split_whitespace().next().unwrap();
            current = if name.starts_with('[') { "[any]" } else { name }.to_string();
            assert!(
                synopsis.insert(current.clone(), String::new()).is_none(),
                "`keywatch {current}` twice"
            );
        }
        let text = synopsis.get_mut(&current).expect("a `keywatch` line first");
        text.push_str(line);
        text.push('\n');
    }

    let (commands, global) = cli_help(&[]);
    let global_flags: BTreeSet<String> = global.iter().flatten().cloned().collect();
    let mut shown: Vec<&str> = synopsis.keys().map(String::as_str).collect();
    shown.retain(|c| *c != "[any]");
    let mut sorted = commands.clone();
    sorted.sort();
    assert_eq!(
        shown, sorted,
        "docs/commands.md and `keywatch --help` differ"
    );
    let any = synopsis
        .get("[any]")
        .expect("a `keywatch [--log-format …]` line");
    assert_eq!(
        flags_in(any),
        global_flags,
        "the options of every command: {any}"
    );

    let mut problems = Vec::new();
    for command in &commands {
        let text = &synopsis[command];
        // The command's options, and those of its subcommands (`dead retry --all`).
        let (subcommands, mut options) = cli_help(&[command]);
        for sub in &subcommands {
            if !text
                .split(|c: char| !c.is_alphanumeric() && c != '-')
                .any(|w| w == sub)
            {
                problems.push(format!("`keywatch {command}` lacks its subcommand `{sub}`"));
            }
            options.extend(cli_help(&[command, sub]).1);
        }
        options.retain(|o| !o.iter().any(|s| global_flags.contains(s)));
        options.sort();
        options.dedup();
        let written = flags_in(text);
        for spellings in &options {
            if !spellings.iter().any(|s| written.contains(s)) {
                problems.push(format!(
                    "`keywatch {command}` lacks {}",
                    spellings.join("/")
                ));
            }
        }
        for flag in written {
            if !options.iter().any(|o| o.contains(&flag)) {
                problems.push(format!("`keywatch {command}` has no option {flag}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "docs/commands.md:\n{}",
        problems.join("\n")
    );
}

/// The file of module `name` under `dir` (`name.rs` or `name/mod.rs`), and the folder of its
/// own submodules.
fn submodule(dir: &std::path::Path, name: &str) -> Result<(PathBuf, PathBuf), String> {
    let (as_file, as_dir) = (dir.join(format!("{name}.rs")), dir.join(name));
    if as_file.is_file() {
        Ok((as_file, as_dir))
    } else if as_dir.join("mod.rs").is_file() {
        Ok((as_dir.join("mod.rs"), as_dir))
    } else {
        Err(format!("no module `{name}` in {}", dir.display()))
    }
}

/// Whether `text` defines type `name` or re-exports it (`pub use integration::Channel;`,
/// `pub use x::{A, Channel}`).
fn defines_type(text: &str, name: &str) -> bool {
    let defines = ["struct", "enum", "trait", "type"].iter().any(|k| {
        [" ", "<", "("]
            .iter()
            .any(|end| text.contains(&format!("{k} {name}{end}")))
    });
    let reexports = text.split("pub use ").skip(1).any(|statement| {
        statement
            .split(';')
            .next()
            .unwrap_or_default()
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .any(|w| w == name)
    });
    defines || reexports
}

/// Where `path` (`store::queue::Window`, `delivery::work::Work::Digest`, `store::lease()`,
/// `internal_events`) is defined under `src/`, or why it is not. `module` is the file the
/// previous path of the same cell named, for a bare type (`Permit` after
/// `delivery::admit::Concurrency`).
fn defined(path: &str, module: &mut Option<PathBuf>) -> Result<(), String> {
    let segments: Vec<&str> = path.split("::").collect();
    let mut dir = repo().join("src");
    let mut file = module.clone().filter(|_| segments.len() == 1);
    let mut types = 0;
    for seg in &segments {
        let text = || {
            file.as_ref()
                .map(|f| std::fs::read_to_string(f).unwrap())
                .ok_or_else(|| format!("`{seg}` outside a module"))
        };
        if let Some(function) = seg.strip_suffix("()") {
            if !text()?.contains(&format!("fn {function}(")) {
                return Err(format!("no fn {function}"));
            }
        } else if seg.starts_with(char::is_uppercase) {
            let text = text()?;
            let found = if types == 0 {
                defines_type(&text, seg)
            } else {
                [" {", ",", "("]
                    .iter()
                    .any(|end| text.contains(&format!("\n    {seg}{end}")))
            };
            if !found {
                return Err(format!(
                    "no {} `{seg}`",
                    if types == 0 { "type" } else { "variant" }
                ));
            }
            types += 1;
        } else {
            let (f, d) = submodule(&dir, seg)?;
            (file, dir) = (Some(f), d);
        }
    }
    *module = file;
    Ok(())
}

/// The glossary of docs/how-it-works.md names what the code calls each word, and each of those
/// names is defined in `src/` (its first row once named `event::Event`, which does not exist).
#[test]
fn the_glossarys_code_names_exist() {
    let doc = read("docs/how-it-works.md");
    let start = doc.find("\n## Glossary\n").expect("a glossary");
    let section = &doc[start + 1..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
    let mut names = 0;
    let mut problems = Vec::new();
    for line in section.lines() {
        // The table's third column, or the prose's paths.
        let code = match line.strip_prefix('|') {
            Some(row) => row.split('|').nth(2).unwrap_or_default(),
            None => line,
        };
        let mut module = None;
        for item in code.split('`').skip(1).step_by(2) {
            let is_name = item.contains("::")
                || (line.starts_with('|') && item.chars().all(|c| c.is_alphanumeric() || c == '_'));
            if !is_name || item.chars().any(|c| c == ' ' || c == '.' || c == '{') {
                continue;
            }
            names += 1;
            if let Err(why) = defined(item, &mut module) {
                problems.push(format!("`{item}`: {why}"));
            }
        }
    }
    assert!(names > 30, "{names} names read: is the table still there?");
    assert!(
        problems.is_empty(),
        "docs/how-it-works.md#glossary names what src/ does not define:\n{}",
        problems.join("\n")
    );
}
