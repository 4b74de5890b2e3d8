//! `keywatch check` on fixture files: every diagnostic compared exactly, with its exit code.
//!
//! Each fixture is a rule file (or a folder of them) in `tests/fixtures/check/` with a
//! `.expected` file beside it: the first line is `exit: N`, the rest is the exact stderr.
//! `UPDATE_FIXTURES=1 cargo test --test e2e check_fixtures::` rewrites the `.expected` files; review
//! the diff before committing it.

use crate::common;

use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/check")
}

fn check(name: &str, envs: &[(&str, &str)]) {
    let dir = fixtures();
    let out = common::keywatch_command(["check", "-r", name], envs)
        .current_dir(&dir)
        .output()
        .expect("run keywatch");
    let actual = format!(
        "exit: {}\n{}",
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr)
    );
    let expected_path = dir.join(format!("{}.expected", name.trim_end_matches(".yaml")));
    if std::env::var_os("UPDATE_FIXTURES").is_some() {
        std::fs::write(&expected_path, &actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&expected_path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run with UPDATE_FIXTURES=1 to create it)",
            expected_path.display()
        )
    });
    assert_eq!(
        actual,
        expected,
        "stderr of `keywatch check -r {name}` differs from {}",
        expected_path.display()
    );
}

#[test]
fn yaml_syntax_errors_have_a_place() {
    check("syntax.yaml", &[]);
}

#[test]
fn unknown_fields_say_what_was_meant() {
    check("unknown_fields.yaml", &[]);
}

#[test]
fn wrong_types_are_all_reported_at_once() {
    check("types.yaml", &[]);
}

#[test]
fn meaning_errors_point_at_the_offending_value() {
    check("meaning.yaml", &[]);
}

#[test]
fn templates_are_rendered_strictly_at_check_time() {
    check("templates.yaml", &[]);
}

#[test]
fn names_defined_twice_across_files_name_both_places() {
    check("duplicates", &[]);
}

#[test]
fn unset_variables_warn_at_check_and_defaults_apply() {
    check(
        "env.yaml",
        &[("KEYWATCH_FIXTURE_SET", "https://hooks.example/x")],
    );
}

#[test]
fn a_valid_file_passes() {
    check("valid.yaml", &[]);
}

#[test]
fn unreadable_input_exits_2() {
    check("does-not-exist.yaml", &[]);
}

#[test]
fn sentinel_mistakes_are_located() {
    check("sentinel.yaml", &[]);
}

#[test]
fn sentinel_without_master_or_nodes_says_what_is_missing() {
    check("sentinel_incomplete.yaml", &[]);
}

#[test]
fn exec_env_names_and_templates_are_checked_at_their_place() {
    check("exec_env.yaml", &[]);
}

#[test]
fn recover_long_form_is_checked_at_its_place() {
    check("recover.yaml", &[]);
}

#[test]
fn templates_that_render_other_templates_are_refused_at_their_place() {
    check("include.yaml", &[("RELOAD_TOKEN", "s3cret-reload-token")]);
}

#[test]
fn hash_field_rules_are_checked_at_their_place() {
    check("hash_fields.yaml", &[]);
}

#[test]
fn email_channels_are_checked_where_written() {
    check("email.yaml", &[]);
}

#[test]
fn alertmanager_channels_refuse_captures_that_are_not_their_own_labels() {
    check("alertmanager.yaml", &[]);
}
