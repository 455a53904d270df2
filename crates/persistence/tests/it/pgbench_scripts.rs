//! The pgbench references in `bench/pgbench/` send the library's registered
//! statements (`idemstage_persistence::statements`), each `$n` a pgbench
//! parameter (`-M prepared`): a statement's text with its binds replaced by the
//! script's expressions must appear in the script, whitespace aside. No database
//! needed; `cargo xtask bench` checks what the scripts wrote.

use std::path::{Path, PathBuf};

use idemstage_persistence::statements;

fn script(name: &str) -> String {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let path: PathBuf = crate_dir
        .parent()
        .and_then(Path::parent)
        .expect("crates/persistence lies two levels below the workspace root")
        .join("bench/pgbench")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Whitespace runs become one space.
fn squash(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `statement`'s SQL with `$n` replaced by `binds[n - 1]` (highest first, so that
/// `$1` does not eat into `$10`).
fn rendered(statement: &str, binds: &[&str]) -> String {
    let mut sql = statements::get(statement)
        .unwrap_or_else(|| panic!("no registered statement {statement}"))
        .sql;
    for (i, bind) in binds.iter().enumerate().rev() {
        let placeholder = format!("${}", i + 1);
        assert!(
            sql.contains(&placeholder),
            "{statement} has no {placeholder}"
        );
        sql = sql.replace(&placeholder, bind);
    }
    assert!(
        !sql.contains('$'),
        "{statement} has more binds than given: {sql}"
    );
    squash(&sql)
}

const RUN_ID: &str = "lpad((:r)::text, 26, '0')";
const ITEM: &str = "lpad((:a)::text, 26, '0')";
const NULL_INT: &str = "nullif(:none, 0)";

/// The claim's binds (see `runs::sql::CLAIM`), with the stage and the upstream.
fn claim_binds<'a>(stage: &'a str, upstream: &'a str) -> [&'a str; 10] {
    [
        RUN_ID,
        ":tenant",
        ITEM,
        stage,
        ":max_attempts",
        ":input_hash",
        ":worker",
        ":lease_us",
        ":rerun",
        upstream,
    ]
}

fn assert_sends(script_name: &str, expected: &[(&str, Vec<&str>)]) {
    let text = script(script_name);
    let squashed = squash(&text);
    for (statement, binds) in expected {
        let sql = rendered(statement, binds);
        assert!(
            squashed.contains(&format!("{sql};")),
            "{script_name} does not send {statement} as the library does:\n{sql}"
        );
    }
    // Prepared mode: the scripts themselves hold no placeholders, only variables.
    let sql_lines = text.lines().filter(|l| !l.starts_with("--"));
    assert!(
        sql_lines.clone().all(|l| !l.contains('$')),
        "{script_name} has a literal placeholder"
    );
}

#[test]
fn pgbench_claim_scripts_send_the_registered_statements() {
    let scope = vec![":tenant", ":idle_ms"];
    assert_sends(
        "claim_insert.sql",
        &[
            ("tenant_scope", scope.clone()),
            ("run_claim", claim_binds("'s' || :r", NULL_INT).to_vec()),
        ],
    );
    assert_sends(
        "claim_skip.sql",
        &[
            ("tenant_scope", scope.clone()),
            ("run_claim", claim_binds(":done_stage", NULL_INT).to_vec()),
            (
                "run_explain_skip",
                vec![":tenant", ITEM, ":done_stage", NULL_INT],
            ),
        ],
    );
}

#[test]
fn pgbench_stage_script_sends_the_registered_statements() {
    assert_sends(
        "stage.sql",
        &[
            ("tenant_scope", vec![":tenant", ":idle_ms"]),
            (
                "run_claim",
                claim_binds("'s' || :st || :r", ":done_stage").to_vec(),
            ),
            ("run_lineage_current", vec![RUN_ID, ":attempt"]),
            ("run_fence_success", vec![RUN_ID, ":attempt"]),
            (
                "job_send_quiet",
                vec![
                    "lpad((:r5)::text, 26, '0')",
                    ":next_queue",
                    ":priority",
                    "jsonb_build_object('tenant_id', :tenant::text, 'item_id', lpad((:a)::text, 26, '0'), 'input_hash', :input_hash::text)",
                    ":next_queue || ':' || :tenant || ':' || lpad((:a)::text, 26, '0') || ':' || :r",
                    NULL_INT,
                    ":retry_limit",
                    ":retry_delay_ms",
                    ":retry_backoff",
                    ":retry_delay_max_ms",
                    ":expire_in_ms",
                    "nullif(:none, 0)::text",
                    ":start_after_ms",
                    ":tenant",
                ],
            ),
            // Job mode (`-D job=1`): the completion of the fetched job, its k-th.
            (
                "job_complete",
                vec![
                    "(:ids::text[])[:k]",
                    "(:attempts::int[])[:k]",
                    "nullif(:none, 0)::text::jsonb",
                ],
            ),
        ],
    );
    // The job mode's fetch is the worker's (its commit asynchronous): the
    // registered statement's FROM with its binds, its rows gathered into arrays
    // for the executions that follow.
    let fetch = statements::get("job_fetch_async_commit")
        .expect("job_fetch_async_commit")
        .sql;
    let call = fetch
        .strip_prefix("SELECT f.* FROM ")
        .expect("job_fetch_async_commit selects from functions")
        .replace("$1", ":queues::text[]")
        .replace("$2", ":batch");
    assert!(
        squash(&script("stage.sql")).contains(&format!("FROM {call} \\gset")),
        "stage.sql does not fetch as the library does: {call}"
    );
}
