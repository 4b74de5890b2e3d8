//! The declarations of [`super::permissions::REGISTRY`] against the code: a command a file
//! sends that its module did not declare would be missing from the doctor's check and from the
//! documented ACL (the user gets `NOPERM` in production), and a declaration nothing sends any
//! more grants too much.
//!
//! The code is read as text. A file's commands are what it names in `redis::cmd("X")`,
//! `.cmd("X")`, `per_key("X", …)`, `each_key(conn, "X", …)` and its Lua's `redis.call('X', …)`
//! (the Lua of the `.lua` files it loads with `include_str!` included; with a subcommand,
//! `CONFIG GET`, as `config|get`), the pub/sub calls, the scripts it runs (`EVALSHA`,
//! `SCRIPT LOAD`), and what the client library sends for the helpers it calls.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::permissions::REGISTRY;

/// How a declaration starts.
const DECLARE: &str = "commands::declare! {";

/// Files that talk to a Redis of their own, which no ACL guards: it is started for them.
const EXEMPT: &[&str] = &[
    // `keywatch demo` seeds the redis-server it starts.
    "src/command/demo.rs",
    // Waits for a local redis-server it started to answer.
    "src/local_redis/mod.rs",
    // The delivery stage's tests (only): they set up the Redis users their stages run as.
    "src/delivery/testkit.rs",
];

/// Commands whose ACL name includes their first argument.
const CONTAINERS: &[&str] = &[
    "ACL", "CLIENT", "CLUSTER", "COMMAND", "CONFIG", "FUNCTION", "MEMORY", "OBJECT", "SCRIPT",
    "SENTINEL", "XINFO",
];

/// Calls that send commands by other names: helpers of this crate and of the Redis client.
const HELPERS: &[(&str, &[&str])] = &[
    ("Script::new(", &["evalsha", "script|load"]),
    ("scan_page(", &["scan"]),
    ("set_db(", &["select"]),
    ("ClusterClientBuilder", &["cluster|slots", "asking"]),
    (".ping::<", &["ping"]),
    (".atomic()", &["multi", "exec"]),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file: without its tests (which send whatever sets up a case) and its
/// declaration (which names every command).
fn code(text: &str) -> String {
    let text = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |i| &text[..i]);
    match text.find(DECLARE) {
        Some(start) => {
            let end = text[start..]
                .find("\n}\n")
                .map_or(text.len(), |e| start + e + 3);
            format!("{}{}", &text[..start], &text[end..])
        }
        None => text.to_string(),
    }
}

/// `code` followed by the Lua of every `.lua` file it loads (`include_str!("x.lua")`, a path
/// relative to the file at `path`): a script's commands are its loader's.
fn with_lua(path: &Path, code: &str) -> String {
    const LOAD: &str = "include_str!(\"";
    let mut out = code.to_string();
    for (i, _) in code.match_indices(LOAD) {
        let Some(name) = literal(code, i + LOAD.len(), '"') else {
            continue;
        };
        if name.ends_with(".lua") {
            let lua = path.parent().unwrap().join(name);
            out.push('\n');
            out.push_str(
                &std::fs::read_to_string(&lua)
                    .unwrap_or_else(|e| panic!("{} loads {name}: {e}", path.display())),
            );
        }
    }
    out
}

/// The literal that `code[at..]` starts with, up to `quote`.
fn literal(code: &str, at: usize, quote: char) -> Option<&str> {
    let rest = &code[at..];
    rest.find(quote).map(|end| &rest[..end])
}

/// The ACL name of command `name`, its subcommand read from the `.arg("…")` that follows.
fn acl_name(name: &str, after: &str) -> String {
    let lower = name.to_ascii_lowercase();
    if !CONTAINERS.contains(&name.to_ascii_uppercase().as_str()) {
        return lower;
    }
    let sub = after
        .find(".arg(\"")
        .and_then(|i| literal(after, i + 6, '"'))
        .unwrap_or("?");
    format!("{lower}|{}", sub.to_ascii_lowercase())
}

/// The commands `code` sends.
fn sent(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for opener in ["redis::cmd(\"", ".cmd(\"", "per_key(\""] {
        for (i, _) in code.match_indices(opener) {
            let at = i + opener.len();
            if let Some(name) = literal(code, at, '"') {
                out.insert(acl_name(name, &code[at + name.len()..]));
            }
        }
    }
    // `each_key(conn, "X", keys)`: the command is its second argument.
    for (i, _) in code.match_indices("each_key(") {
        let args = &code[i..code.len().min(i + 80)];
        if let Some(q) = args.find('"')
            && let Some(name) = literal(code, i + q + 1, '"')
        {
            out.insert(name.to_ascii_lowercase());
        }
    }
    for opener in ["redis.call('", "redis.pcall('"] {
        for (i, _) in code.match_indices(opener) {
            if let Some(name) = literal(code, i + opener.len(), '\'') {
                out.insert(name.to_ascii_lowercase());
            }
        }
    }
    for method in ["subscribe", "unsubscribe", "psubscribe", "punsubscribe"] {
        let call = format!(".{method}(");
        for (i, _) in code.match_indices(&call) {
            // `watch::Sender::subscribe()` and the like take no channel.
            if !code[i + call.len()..].starts_with(')') {
                out.insert(method.to_string());
            }
        }
    }
    for (call, commands) in HELPERS {
        let called = code
            .match_indices(call)
            .any(|(i, _)| !code[..i].ends_with("fn "));
        if called {
            out.extend(commands.iter().map(|c| c.to_string()));
        }
    }
    // A file that builds commands from names it is given (`redis::cmd(key_cmd)`) names them
    // elsewhere in its code: every upper-case literal there is one.
    let from_names = code
        .match_indices("redis::cmd(")
        .any(|(i, _)| !code[i + 11..].starts_with('"'));
    if from_names {
        for (i, _) in code.match_indices('"') {
            let before = &code[..i];
            // Arguments, byte strings, and names read above.
            if before.ends_with(".arg(") || before.ends_with('b') || before.ends_with("cmd(") {
                continue;
            }
            if let Some(word) = literal(code, i + 1, '"') {
                let upper = word.len() > 1 && word.bytes().all(|b| b.is_ascii_uppercase());
                if upper && before.ends_with([' ', '(', ',']) {
                    out.insert(word.to_ascii_lowercase());
                }
            }
        }
    }
    out
}

/// The files a declaration of `file` answers for: its own, and those of its submodules that
/// declare nothing themselves (`store/queue.rs` for `store/queue/writer.rs`).
fn answers_for(declared: &BTreeSet<String>, file: &str) -> String {
    if declared.contains(file) {
        return file.to_string();
    }
    let dir = Path::new(file).parent().unwrap();
    let candidates = [
        dir.with_extension("rs"),
        dir.join("mod.rs"),
        dir.parent().unwrap().join("mod.rs"),
    ];
    for c in candidates {
        let c = c.to_string_lossy().into_owned();
        if c != file && declared.contains(&c) && !c.ends_with("src/mod.rs") {
            return c;
        }
    }
    file.to_string()
}

/// Every command sent by a file outside [`EXEMPT`], by the declaring file that answers for it.
fn sent_by_declaring_file() -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    let declared: BTreeSet<String> = REGISTRY.iter().map(|d| d.file.to_string()).collect();
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for path in files {
        let file = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        // This file names commands to test itself.
        if file == file!() {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            !text.contains(DECLARE) || declared.contains(&file),
            "{file} declares its Redis commands, but permissions::REGISTRY does not list it: the doctor would not check them"
        );
        let code = with_lua(&path, &code(&text));
        for typed in ["AsyncCommands", "TypedCommands", "redis::Commands"] {
            assert!(
                !code.contains(typed),
                "{file} uses redis-rs's typed commands ({typed}), which this test cannot see: send them with redis::cmd(\"…\")"
            );
        }
        if EXEMPT.contains(&file.as_str()) {
            continue;
        }
        let commands = sent(&code);
        if !commands.is_empty() {
            out.entry(answers_for(&declared, &file))
                .or_default()
                .extend(commands);
        }
    }
    out
}

#[test]
fn every_command_sent_is_declared_and_every_declaration_sent() {
    let sent = sent_by_declaring_file();
    let mut problems = Vec::new();
    for (file, commands) in &sent {
        let declared: BTreeSet<&str> = REGISTRY
            .iter()
            .filter(|d| d.file == file)
            .flat_map(|d| d.uses.iter().map(|u| u.command))
            .collect();
        for c in commands.iter().filter(|c| !declared.contains(c.as_str())) {
            problems.push(format!(
                "{file} sends `{c}` but declares no such command in its REDIS"
            ));
        }
    }
    for d in REGISTRY {
        let commands = sent.get(d.file).cloned().unwrap_or_default();
        for u in d.uses.iter().filter(|u| !commands.contains(u.command)) {
            problems.push(format!(
                "{} declares `{}` ({}) but sends no such command: a stale grant",
                d.file, u.command, u.why
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_scan_reads_each_way_of_sending() {
    let code = r#"
        redis::cmd("CONFIG").arg("GET").arg("x");
        pipe.cmd("ZADD").arg(k);
        conn.each(per_key("EXISTS", keys));
        local x = redis.call('HGET', KEYS[1])
        let s = redis::Script::new(LUA);
        sink.unsubscribe(ch);
        let rx = tx.subscribe();
        pub async fn scan_page() {}
        let mut c = redis::cmd(key_cmd);
        Plan::of(at, "HMGET", "GET");
        format!("{}", "NOPE".len()).arg("NX");
    "#;
    let got: Vec<String> = sent(code).into_iter().collect();
    assert_eq!(
        got,
        [
            "config|get",
            "evalsha",
            "exists",
            "get",
            "hget",
            "hmget",
            "nope",
            "script|load",
            "unsubscribe",
            "zadd"
        ]
    );
}
