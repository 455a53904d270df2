//! Why the corrections of DESIGN.md section 1 are needed: the seed's statements run
//! against our schema and do the wrong thing; ours do the right thing. (The fixed
//! behaviour itself is tested in crates/persistence/tests/it/claim.rs.)

use diesel::prelude::*;
use diesel::upsert::excluded;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{
    ClaimOutcome, ClaimRequest, SkipReason, StageName, StagePolicy, TenantId, WorkerId,
};
use idemstage_persistence::schema::stage_runs;
use idemstage_persistence::PgRunRepository;

use crate::support::*;

/// The seed's claim with the guard on the conflict target, as Diesel's
/// `filter_target` writes it: `ON CONFLICT (cols) WHERE status <> 'success'`.
async fn seed_claim_with_filter_target(
    conn: &mut diesel_async::AsyncPgConnection,
    tenant: &str,
    item: &str,
) -> Option<(String, i32)> {
    use stage_runs::dsl as pr;
    diesel::insert_into(pr::stage_runs)
        .values((
            pr::id.eq(idemstage_domain::RunId::new().to_string()),
            pr::tenant_id.eq(tenant),
            pr::item_id.eq(item),
            pr::stage.eq("intake"),
            pr::status.eq("running"),
            pr::attempts.eq(1),
            pr::max_attempts.eq(100),
            pr::input_hash.eq("h"),
            pr::worker_id.eq("seed"),
            pr::started_at.eq(diesel::dsl::now),
            pr::lease_expires_at.eq(diesel::dsl::now),
        ))
        .on_conflict((pr::tenant_id, pr::item_id, pr::stage))
        .filter_target(pr::status.ne("success"))
        .do_update()
        .set((
            pr::status.eq("running"),
            pr::attempts.eq(pr::attempts + 1),
            pr::worker_id.eq(excluded(pr::worker_id)),
        ))
        .returning((pr::status, pr::attempts))
        .get_result(conn)
        .await
        .optional()
        .unwrap()
}

fn request(tenant: &TenantId, item: idemstage_domain::ItemId, hash: &str) -> ClaimRequest {
    ClaimRequest {
        tenant: tenant.clone(),
        item,
        stage: StageName::parse("intake").unwrap(),
        input_hash: hash.to_owned(),
        worker: WorkerId::generate(),
        policy: StagePolicy::default(),
        upstream: None,
    }
}

/// Correction 1: against a `success` row the `filter_target` form claims again
/// (attempts = 2, status = running): the predicate only selects the arbiter index.
/// Our `DO UPDATE … WHERE` form skips and leaves the row alone.
#[tokio::test]
async fn correction_1_a_guard_on_the_conflict_target_filters_nothing() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let t = TenantId::parse("t1").unwrap();
    let (item, hash) = item(&mut conn, &t, "1 Stk Test").await;
    conn.batch_execute(&format!(
        "INSERT INTO stage_runs (id, tenant_id, item_id, stage, status, attempts,
             max_attempts, input_hash, worker_id, started_at, lease_expires_at, finished_at,
             success_attempt)
         VALUES ('{}', 't1', '{item}', 'intake', 'success', 1, 100, '{hash}', 'w',
             now(), now(), now(), 1)",
        idemstage_domain::RunId::new()
    ))
    .await
    .unwrap();

    let repo = PgRunRepository::new(db.pool(2).await);
    assert!(matches!(
        repo.claim(&request(&t, item, &hash)).await.unwrap(),
        ClaimOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
    ));
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs WHERE status = 'success' AND attempts = 1"
        )
        .await,
        1
    );

    // The seed's form re-claims the finished stage.
    let seed = seed_claim_with_filter_target(&mut conn, "t1", &item.to_string()).await;
    assert_eq!(seed, Some(("running".to_owned(), 2)));
}

/// Correction 2: the seed's guard `status <> 'success'` lets a second worker take a
/// stage that another worker is still running; the lease guard does not.
#[tokio::test]
async fn correction_2_the_seed_guard_claims_a_running_stage_twice() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let t = TenantId::parse("t1").unwrap();
    let (item, hash) = item(&mut conn, &t, "1 Stk Test").await;
    let repo = PgRunRepository::new(db.pool(2).await);
    assert!(matches!(
        repo.claim(&request(&t, item, &hash)).await.unwrap(),
        ClaimOutcome::Claimed { attempt: 1, .. }
    ));
    assert!(matches!(
        repo.claim(&request(&t, item, &hash)).await.unwrap(),
        ClaimOutcome::Skipped(SkipReason::InFlight { .. })
    ));
    // The seed's statement, with its guard where it belongs, still re-claims.
    let seed_claimed = diesel::sql_query(format!(
        "INSERT INTO stage_runs (id, tenant_id, item_id, stage, status, attempts,
                 max_attempts, input_hash, worker_id, started_at, lease_expires_at)
             VALUES ('{}', 't1', '{item}', 'intake', 'running', 1, 100, '{hash}', 'seed',
                 now(), now())
             ON CONFLICT (tenant_id, item_id, stage) DO UPDATE
                SET status = 'running', attempts = stage_runs.attempts + 1
              WHERE stage_runs.status <> 'success'
             RETURNING id",
        idemstage_domain::RunId::new()
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(seed_claimed, 1, "two workers now both run the stage");
}
