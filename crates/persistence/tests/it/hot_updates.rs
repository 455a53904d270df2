//! A completion changes no indexed column of `stage_runs`, so it is a HOT
//! update: no new index entry, and the old version is pruned by a later read of
//! its page, without vacuum (docs/storage-under-pressure.md). An index on a
//! column the completion writes (the status, the lease) would make every
//! completion leave an entry behind in every index of the table, one more that
//! a held snapshot keeps from being removed. The attempt's end is inserted
//! once, never updated: no version of it is left at all.

use std::time::{Duration, Instant};

use diesel::sql_types::BigInt;
use diesel_async::RunQueryDsl;
use idemstage_domain::CompleteOutcome;
use idemstage_testkit::TestDb;

use crate::support::*;

const RUNS: i64 = 300;

#[derive(diesel::QueryableByName, Debug)]
struct Updates {
    #[diesel(sql_type = BigInt)]
    all: i64,
    #[diesel(sql_type = BigInt)]
    hot: i64,
    #[diesel(sql_type = BigInt)]
    inserts: i64,
}

#[tokio::test]
async fn a_completion_is_a_hot_update_of_the_run_and_one_insert_of_its_attempt() {
    let db = TestDb::new().await;
    let repo = repo(&db, 1).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let item = new_item(&mut conn, &t).await;
    let write = write_fn(noop);
    for i in 0..RUNS {
        let req = request(&t, item, &format!("s{i}"));
        let token = token_of(&req, &repo.claim(&req).await.unwrap());
        assert_eq!(
            repo.complete(&token, &write).await.unwrap(),
            CompleteOutcome::Committed
        );
    }
    // The counts reach the statistics when the repository's backend reports them
    // (at the latest when it exits): await them.
    drop(repo);
    let deadline = Instant::now() + Duration::from_secs(60);
    let updates = |table: &'static str| {
        diesel::sql_query(format!(
            "SELECT coalesce(sum(n_tup_upd), 0)::bigint AS all, \
                    coalesce(sum(n_tup_hot_upd), 0)::bigint AS hot, \
                    coalesce(sum(n_tup_ins), 0)::bigint AS inserts \
               FROM pg_stat_user_tables WHERE relname = '{table}'"
        ))
    };
    let (runs, attempts) = loop {
        // A fresh snapshot of the statistics each time.
        diesel::sql_query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut conn)
            .await
            .unwrap();
        let runs: Updates = updates("stage_runs").get_result(&mut conn).await.unwrap();
        let attempts: Updates = updates("stage_attempt_ends")
            .get_result(&mut conn)
            .await
            .unwrap();
        if runs.all >= RUNS && attempts.inserts >= RUNS {
            break (runs, attempts);
        }
        assert!(
            Instant::now() < deadline,
            "the statistics never showed the {RUNS} completions: {runs:?} {attempts:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        runs.hot * 10 >= runs.all * 9,
        "completions that were not HOT updates: stage_runs {runs:?}"
    );
    assert_eq!(
        (attempts.inserts, attempts.all),
        (RUNS, 0),
        "an attempt's end is one insert and no update: {attempts:?}"
    );
}

/// The tables the hot path updates or deletes from are vacuumed once they have
/// 1,000 dead tuples, whatever their size: at the default (20 % of the rows)
/// `jobs`, which keeps the finished jobs for the retention, would wait for more
/// dead tuples the longer it ran (migration `2026-12-05-000000_vacuum_by_count`).
#[tokio::test]
async fn the_hot_tables_are_vacuumed_by_count_not_by_size() {
    #[derive(diesel::QueryableByName, Debug)]
    struct Options {
        #[diesel(sql_type = diesel::sql_types::Text)]
        relname: String,
        #[diesel(sql_type = diesel::sql_types::Array<diesel::sql_types::Text>)]
        options: Vec<String>,
    }
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let hot = [
        "fanout_children",
        "fanouts",
        "job_claims",
        "job_lanes",
        "jobs",
        "queue_buckets",
        "stage_checkpoints",
        "stage_runs",
        "stage_waits",
    ];
    let rows: Vec<Options> = diesel::sql_query(
        "SELECT c.relname::text AS relname, coalesce(c.reloptions, '{}') AS options \
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
          WHERE n.nspname = 'public' AND c.relname = ANY($1) ORDER BY 1",
    )
    .bind::<diesel::sql_types::Array<diesel::sql_types::Text>, _>(hot.to_vec())
    .load(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        rows.iter().map(|r| r.relname.as_str()).collect::<Vec<_>>(),
        hot,
        "a hot table is missing"
    );
    for r in &rows {
        for want in [
            "autovacuum_vacuum_scale_factor=0",
            "autovacuum_vacuum_threshold=1000",
        ] {
            assert!(
                r.options.iter().any(|o| o == want),
                "{} is vacuumed by its size: {:?}",
                r.relname,
                r.options
            );
        }
    }
}

/// No UPDATE of `jobs` pays for a BEFORE ROW trigger: with one on the table,
/// the executor fetches and locks each old row for it before it looks at the
/// trigger's columns or its WHEN, so every lease, renewal and completion paid,
/// 13-15 % of the UPDATE (migration `2026-12-05-050000_jobs_after_triggers`).
/// The labels' check and the ready-again number run AFTER the UPDATE instead;
/// tests `job_labels` and `floors` hold them to what they do.
#[tokio::test]
async fn no_update_of_jobs_pays_for_a_before_row_trigger() {
    #[derive(diesel::QueryableByName, Debug)]
    struct Trigger {
        #[diesel(sql_type = diesel::sql_types::Text)]
        tgname: String,
    }
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // tgtype: 1 a row trigger, 2 BEFORE, 16 on UPDATE.
    let before_row_update: Vec<Trigger> = diesel::sql_query(
        "SELECT tgname::text AS tgname FROM pg_trigger \
          WHERE tgrelid = 'public.jobs'::regclass AND NOT tgisinternal \
            AND tgtype & 1 = 1 AND tgtype & 2 = 2 AND tgtype & 16 = 16",
    )
    .load(&mut conn)
    .await
    .unwrap();
    let names: Vec<&str> = before_row_update
        .iter()
        .map(|t| t.tgname.as_str())
        .collect();
    assert!(
        names.is_empty(),
        "BEFORE ROW UPDATE triggers on jobs: {names:?}"
    );
}

/// The attempt history reads the same through the migration that moved the
/// ends into a table of their own (`2026-12-06-010000_attempt_ends`), down and
/// up again, with attempts in every shape: ended by a failure, a success, a
/// release, and one still running.
#[tokio::test]
async fn the_attempt_history_is_the_same_across_the_attempt_ends_migration() {
    use diesel_async::SimpleAsyncConnection;
    let db = TestDb::new().await;
    let repo = repo(&db, 1).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let item = new_item(&mut conn, &t).await;
    let write = write_fn(noop);
    // s0: attempt 1 failed, attempt 2 succeeded. s1: released, claimed again,
    // running. s2: running.
    let req = request(&t, item, "s0");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.fail(&token, "boom", true).await.unwrap();
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    assert_eq!(
        repo.complete(&token, &write).await.unwrap(),
        CompleteOutcome::Committed
    );
    let req = request(&t, item, "s1");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.release(&token, "shutting down").await.unwrap();
    repo.claim(&req).await.unwrap();
    let req = request(&t, item, "s2");
    repo.claim(&req).await.unwrap();

    #[derive(diesel::QueryableByName, Debug, PartialEq)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        outcome: String,
        #[diesel(sql_type = diesel::sql_types::Text)]
        row: String,
    }
    let history = "SELECT outcome,
                          concat_ws(' ', run_id, attempt, tenant_id, worker_id, input_hash,
                                    started_at, finished_at IS NULL, error,
                                    upstream_attempt) AS row
                     FROM stage_run_attempts ORDER BY run_id, attempt";
    let before: Vec<Row> = diesel::sql_query(history).load(&mut conn).await.unwrap();
    let mut sorted: Vec<&str> = before.iter().map(|r| r.outcome.as_str()).collect();
    sorted.sort();
    assert_eq!(
        sorted,
        ["abandoned", "failed", "running", "running", "success"],
        "{before:?}"
    );
    let down = include_str!("../../../../migrations/2026-12-06-010000_attempt_ends/down.sql");
    let up = include_str!("../../../../migrations/2026-12-06-010000_attempt_ends/up.sql");
    conn.batch_execute(down).await.unwrap();
    let old: Vec<Row> = diesel::sql_query(history).load(&mut conn).await.unwrap();
    assert_eq!(old, before, "the former table after the down migration");
    conn.batch_execute(up).await.unwrap();
    let again: Vec<Row> = diesel::sql_query(history).load(&mut conn).await.unwrap();
    assert_eq!(again, before, "the view after the up migration");
}
