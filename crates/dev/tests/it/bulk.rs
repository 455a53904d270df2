//! `idemstage rerun | retry | cancel` over many items as processes: a bulk rerun
//! of 1,000 items killed (SIGKILL) half-way resumes with `--resume` and acts on
//! every item exactly once; the preview changes nothing; bad filters exit 2.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idemstage::ids::ItemId;

use crate::support::{count, enqueue, stdout_json, wait_until, Workers};

fn idemstage(url: &str, args: &[&str]) -> Output {
    crate::support::idemstage_as(url, "bulk-user", args)
}

#[tokio::test]
async fn a_bulk_rerun_of_1000_items_killed_half_way_resumes_and_reruns_each_item_once() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let keys = enqueue(db.url(), 1000).await;
    let mut workers = Workers::start(db.url(), 2, &[]);
    wait_until(db.url(), "1,000 items through the pipeline", 600, |c| {
        c.is_quiet()
    })
    .await;
    workers.stop_all();
    let calculated = "SELECT 1 FROM stage_runs WHERE stage = 'calculate' AND status = 'success'";
    assert_eq!(count(&mut conn, calculated).await, 1000);
    let operator = db.operator_url();

    // Bad filters: exit 2, nothing recorded. One id over the list's limit too.
    let long_list = std::env::temp_dir().join(format!("idemstage-items-{}", ItemId::new()));
    let ids: Vec<String> = (0..=idemstage::ops::BulkFilter::MAX_ITEMS)
        .map(|_| ItemId::new().to_string())
        .collect();
    std::fs::write(&long_list, ids.join("\n")).unwrap();
    let long_list = long_list.to_str().unwrap().to_owned();
    for (args, message) in [
        (
            vec!["rerun", "--stage", "calculate", "--items-file", &long_list],
            "more than 10,000 items",
        ),
        (vec!["rerun", "--stage", "calculate"], "names a tenant"),
        (
            vec![
                "rerun",
                "--stage",
                "calculate",
                "--tenant",
                "t0",
                "--status",
                "done",
            ],
            "unknown run status",
        ),
        (
            vec!["rerun", "--stage", "calculate", "--since", "yesterday"],
            "RFC 3339",
        ),
        (
            vec![
                "rerun",
                "--stage",
                "calculate",
                "--tenant",
                "t0",
                "--batch-size",
                "0",
            ],
            "batch size",
        ),
        (
            vec![
                "retry",
                "--tenant",
                "t0",
                "--resume",
                "01M8ZT9SH08QFRQWM92V3Z7ZJG",
            ],
            "not found",
        ),
    ] {
        let out = idemstage(&operator, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
    std::fs::remove_file(&long_list).unwrap();
    assert_eq!(count(&mut conn, "SELECT 1 FROM bulk_actions").await, 0);

    // The preview: counts, nothing changed.
    let since = "2000-01-01T00:00:00Z";
    let preview = stdout_json(&idemstage(
        &operator,
        &[
            "rerun",
            "--stage",
            "calculate",
            "--since",
            since,
            "--status",
            "success",
            "--dry-run",
            "--json",
        ],
    ));
    assert_eq!(preview["preview"]["selected"], 1000, "{preview}");
    assert_eq!(preview["preview"]["eligible"], 1000, "{preview}");
    assert_eq!(
        preview["preview"]["groups"].as_array().unwrap().len(),
        3,
        "{preview}"
    );
    assert_eq!(count(&mut conn, "SELECT 1 FROM bulk_actions").await, 0);
    assert_eq!(count(&mut conn, calculated).await, 1000);

    // The bulk rerun, killed once a few batches have committed.
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemstage"))
        .args([
            "rerun",
            "--stage",
            "calculate",
            "--since",
            since,
            "--status",
            "success",
        ])
        .args(["--batch-size", "5", "--json"])
        .env("DATABASE_URL", &operator)
        .env("RUST_LOG", "error")
        .env("USER", "bulk-user")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while count(&mut conn, "SELECT 1 FROM bulk_actions WHERE batches >= 10").await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no batch committed");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the bulk rerun exited early"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    child.kill().unwrap();
    child.wait().unwrap();
    #[derive(diesel::QueryableByName)]
    struct Bulk {
        #[diesel(sql_type = diesel::sql_types::Text)]
        id: String,
        #[diesel(sql_type = diesel::sql_types::Integer)]
        acted: i32,
        #[diesel(sql_type = diesel::sql_types::Bool)]
        finished: bool,
    }
    let bulk = || {
        diesel::sql_query("SELECT id, acted, finished_at IS NOT NULL AS finished FROM bulk_actions")
    };
    use diesel_async::RunQueryDsl;
    let killed: Bulk = bulk().get_result(&mut conn).await.unwrap();
    assert!(
        !killed.finished && killed.acted < 1000,
        "killed too late: {}",
        killed.acted
    );
    // What the killed run committed, it recorded: one rerun per item so far.
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM stage_reruns").await,
        i64::from(killed.acted)
    );

    // Resumed (by another operator): every item rerun exactly once.
    let resumed = stdout_json(&idemstage(
        &operator,
        &[
            "rerun",
            "--stage",
            "calculate",
            "--resume",
            &killed.id,
            "--actor",
            "night-shift",
            "--json",
        ],
    ));
    assert_eq!(resumed["bulk"]["acted"], 1000, "{resumed}");
    assert_eq!(resumed["bulk"]["selected"], 1000, "{resumed}");
    assert!(resumed["bulk"]["finished_at"].is_string(), "{resumed}");
    let done: Bulk = bulk().get_result(&mut conn).await.unwrap();
    assert!(done.finished);
    for sql in [
        "SELECT 1 FROM stage_reruns GROUP BY run_id HAVING count(*) = 1",
        "SELECT 1 FROM audit_log WHERE action = 'operator.rerun' GROUP BY entity_id HAVING count(*) = 1",
        "SELECT 1 FROM stage_runs WHERE stage = 'calculate' AND status = 'stale'",
    ] {
        assert_eq!(count(&mut conn, sql).await, 1000, "{sql}");
    }
    // A resume of a finished bulk action changes nothing more.
    let again = stdout_json(&idemstage(
        &operator,
        &[
            "rerun",
            "--stage",
            "calculate",
            "--resume",
            &killed.id,
            "--json",
        ],
    ));
    assert_eq!(again["bulk"]["acted"], 1000, "{again}");
    assert_eq!(count(&mut conn, "SELECT 1 FROM stage_reruns").await, 1000);

    // The workers run each rerun once: two successes of calculate per item,
    // one of every other stage, and the checker finds no double execution.
    let mut workers = Workers::start(db.url(), 2, &[]);
    let check = wait_until(db.url(), "the reruns done", 600, |c| c.is_quiet()).await;
    workers.stop_all();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    let per_item = "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id \
                     WHERE a.outcome = 'success' \
                     GROUP BY r.item_id HAVING count(*) FILTER (WHERE r.stage = 'calculate') = 2 \
                        AND count(*) = 5";
    assert_eq!(count(&mut conn, per_item).await, keys.len() as i64);
}
