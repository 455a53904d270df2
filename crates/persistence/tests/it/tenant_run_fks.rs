//! A row that names a run carries the run's tenant. The foreign
//! keys on `(tenant_id, run_id)` refuse a row of tenant A pointing at B's run, even
//! from the connecting superuser (row-level security does not apply to it, so the
//! schema is the only guard there).

use diesel::result::{DatabaseErrorKind, Error as DieselError};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ClaimOutcome, ItemId, TenantId};
use idemstage_testkit::TestDb;

use crate::support::*;

/// A claimed run of `tenant` for a new item: the run and its attempt row (the
/// trigger writes that one).
async fn run_of(db: &TestDb, tenant: &TenantId) -> (ItemId, String) {
    let item = new_item(&mut db.conn().await, tenant).await;
    match repo(db, 1)
        .await
        .claim(&request(tenant, item, "extract"))
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed { run_id, .. } => (item, run_id.to_string()),
        other => panic!("expected Claimed, got {other:?}"),
    }
}

/// One row of `table` for tenant t1 and its item, naming `run_id`.
fn insert(table: &str, item: &ItemId, run_id: &str) -> String {
    match table {
        "anfrage_extraktionen" => format!(
            "INSERT INTO anfrage_extraktionen
                 (id, tenant_id, item_id, position_index, description, run_id, attempt)
             VALUES ('{}', 't1', '{item}', 0, 'x', '{run_id}', 1)",
            ItemId::new()
        ),
        "feasibility_results" => format!(
            "INSERT INTO feasibility_results (tenant_id, item_id, feasible, run_id, attempt)
             VALUES ('t1', '{item}', true, '{run_id}', 1)"
        ),
        "calculation_results" => format!(
            "INSERT INTO calculation_results (tenant_id, item_id, total_cents, run_id, attempt)
             VALUES ('t1', '{item}', 150, '{run_id}', 1)"
        ),
        // Attempt 1 of each run is running (not ended): the row is attempt 2's.
        "stage_attempt_ends" => format!(
            "INSERT INTO stage_attempt_ends
                 (run_id, attempt, tenant_id, worker_id, input_hash, started_at, finished_at,
                  outcome)
             VALUES ('{run_id}', 2, 't1', 'w', 'h', now(), now(), 'abandoned')"
        ),
        other => panic!("no insert for {other}"),
    }
}

async fn assert_fk_violation(conn: &mut AsyncPgConnection, sql: &str, constraint: &str) {
    match diesel::sql_query(sql).execute(conn).await {
        Err(DieselError::DatabaseError(DatabaseErrorKind::ForeignKeyViolation, info)) => {
            assert_eq!(info.constraint_name(), Some(constraint), "{sql}");
        }
        other => panic!("{sql}\nexpected a violation of {constraint}, got {other:?}"),
    }
}

#[tokio::test]
async fn a_row_of_one_tenant_cannot_name_another_tenants_run() {
    let db = idemstage_harness::example::db().await;
    let (t1, t2) = (tenant("t1"), tenant("t2"));
    let (item, own_run) = run_of(&db, &t1).await;
    let (_, foreign_run) = run_of(&db, &t2).await;
    let mut conn = db.conn().await;
    for table in [
        "anfrage_extraktionen",
        "feasibility_results",
        "calculation_results",
        "stage_attempt_ends",
    ] {
        let constraint = format!("{table}_run_fk");
        assert_fk_violation(&mut conn, &insert(table, &item, &foreign_run), &constraint).await;
        // The same row naming t1's own run is fine.
        diesel::sql_query(insert(table, &item, &own_run))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("{table}: {e}"));
        // Nor can the row be moved under the other tenant's run afterwards.
        let attempt = if table == "stage_attempt_ends" { 2 } else { 1 };
        assert_fk_violation(
            &mut conn,
            &format!(
                "UPDATE {table} SET run_id = '{foreign_run}'
                  WHERE run_id = '{own_run}' AND attempt = {attempt}"
            ),
            &constraint,
        )
        .await;
    }
    // The attempts read from their runs carry their run's tenant.
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id
              WHERE a.attempt = 1 AND a.tenant_id = r.tenant_id"
        )
        .await,
        2
    );
}
