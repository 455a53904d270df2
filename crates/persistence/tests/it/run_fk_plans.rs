//! A row that names a run is checked against `stage_runs` by its foreign key
//! on `(tenant_id, run_id)`. PostgreSQL keeps that check's plan for the
//! connection's life, made at its first checks: made while `stage_runs` is
//! small (a new install, a bench, a test), it must still read one run by its
//! key, not every run of the tenant (migration
//! `2026-12-06-040000_run_key_leads_with_item`: an index of `stage_runs` that
//! led with the tenant tied with `(tenant_id, id)` while the table had a few
//! hundred rows, and won the tie).

use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_testkit::TestDb;

use crate::support::stat_around;

/// Rows of `stage_runs` read so far in this transaction: by sequential scans,
/// and fetched through any of its indexes.
const READ_RUNS: &str = "pg_stat_get_xact_tuples_returned('stage_runs'::regclass)
    + (SELECT sum(pg_stat_get_xact_tuples_fetched(indexrelid)) FROM pg_index
        WHERE indrelid = 'stage_runs'::regclass)";

/// Runs added between two checks.
const STEP: i64 = 50;
/// Runs at the last plan, past the few hundred where the indexes tied; the
/// table then grows to five times that before the checks that count.
const GROWN: i64 = 1_000;

async fn run(conn: &mut AsyncPgConnection, sql: &str) {
    diesel::sql_query(sql).execute(conn).await.unwrap();
}

/// Adds `STEP` runs of tenant t1 (four stages per item), ids after `from`.
async fn add_runs(conn: &mut AsyncPgConnection, from: i64) {
    conn.batch_execute(&format!(
        "INSERT INTO items (tenant_id, id, input_text, input_sha256, s3_key)
             SELECT 't1', lpad(g::text, 26, '0'), 'x', repeat('a', 64), 'k'
               FROM generate_series(({from} + 4) / 4, ({from} + {STEP} + 3) / 4) g
             ON CONFLICT DO NOTHING;
             INSERT INTO stage_runs (id, tenant_id, item_id, stage, status, attempts,
                 max_attempts, input_hash, worker_id, started_at, lease_expires_at)
             SELECT lpad(g::text, 26, '0'), 't1', lpad(((g + 3) / 4)::text, 26, '0'),
                    (ARRAY['intake', 'extract', 'check', 'calculate'])[g % 4 + 1],
                    'running', 1, 3, 'h', 'w', now(), now()
               FROM generate_series({from} + 1, {from} + {STEP}) g"
    ))
    .await
    .unwrap();
}

/// A check of an attempt end of run `run`, attempt `attempt`.
fn check(run: i64, attempt: i64) -> String {
    format!(
        "INSERT INTO stage_attempt_ends (run_id, attempt, tenant_id, worker_id,
             input_hash, started_at, finished_at, outcome)
         VALUES (lpad('{run}', 26, '0'), {attempt}, 't1', 'w', 'h', now(), now(), 'failed')"
    )
}

/// Checks a connection makes before PostgreSQL settles on one plan for its
/// session (five custom plans, then the generic one).
const PLANNING_CHECKS: i64 = 8;

/// Grows `stage_runs` step by step; at every size from `from` runs on, a new
/// connection makes its plan of the check. Then the table grows past them
/// all, no ANALYZE comes, and a check on each of those connections still
/// reads one run.
async fn every_plan_reads_one_run_once_grown(db: &TestDb, from: i64) {
    let mut conn = db.conn().await;
    // Nothing replans behind the test's back.
    run(
        &mut conn,
        "ALTER TABLE stage_runs SET (autovacuum_enabled = false)",
    )
    .await;
    let mut planned = Vec::new();
    let mut runs = 0;
    while runs < GROWN {
        add_runs(&mut conn, runs).await;
        runs += STEP;
        if runs < from {
            continue;
        }
        let mut checking = db.conn().await;
        for attempt in 1..=PLANNING_CHECKS {
            run(&mut checking, &check(runs, attempt)).await;
        }
        planned.push((runs, checking));
    }
    while runs < GROWN * 5 {
        add_runs(&mut conn, runs).await;
        runs += STEP;
    }
    for (size, mut checking) in planned {
        let read = stat_around(&mut checking, READ_RUNS, check(runs, size)).await;
        assert!(
            read <= 2,
            "a foreign-key check planned when stage_runs had {size} runs read {read} \
             runs of {runs}: its plan walks the tenant's runs"
        );
    }
}

/// A new install, or a table emptied by TRUNCATE: PostgreSQL costs a table
/// it never analyzed as ten pages at least, so an index read is planned from
/// the first run on, and it must be the key's.
#[tokio::test]
async fn a_run_check_planned_before_any_analyze_reads_one_run() {
    let db = TestDb::new().await;
    every_plan_reads_one_run_once_grown(&db, 0).await;
}

/// Statistics of an empty table (the benches analyze theirs at the start):
/// below about 300 runs the planner reads the few pages sequentially, and the
/// plan keeps doing so until the next ANALYZE (autovacuum's, a minute at most
/// on a table this busy): PostgreSQL's, for every foreign key. From there on
/// it plans an index read, and it must be the key's (the tenant-led index of
/// the claim's key won this tie up to about 700 runs).
#[tokio::test]
async fn a_run_check_planned_after_analyzing_an_empty_table_reads_one_run() {
    let db = TestDb::new().await;
    run(&mut db.conn().await, "ANALYZE stage_runs").await;
    every_plan_reads_one_run_once_grown(&db, 400).await;
}
