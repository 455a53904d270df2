//! Helpers shared by this binary's tests.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::AsyncPgConnection;
use idemstage_domain::{
    AnfrageId, ClaimOutcome, ClaimRequest, ClaimToken, StageName, StagePolicy, TenantId, WorkerId,
};
use idemstage_persistence::anfragen::register_anfrage;
use idemstage_persistence::PgRunRepository;
use idemstage_testkit::TestDb;

pub const HASH_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
pub const HASH_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

pub fn tenant(s: &str) -> TenantId {
    TenantId::parse(s).unwrap()
}

pub fn stage(s: &str) -> StageName {
    StageName::parse(s).unwrap()
}

pub async fn new_anfrage(conn: &mut AsyncPgConnection, tenant: &TenantId) -> AnfrageId {
    let id = AnfrageId::new();
    register_anfrage(conn, tenant, &id, "10 Stk Schrauben M8")
        .await
        .unwrap();
    id
}

pub fn request(tenant: &TenantId, anfrage: AnfrageId, stage_name: &str) -> ClaimRequest {
    ClaimRequest {
        tenant: tenant.clone(),
        anfrage,
        stage: stage(stage_name),
        input_hash: HASH_A.to_owned(),
        worker: WorkerId::generate(),
        policy: StagePolicy::default(),
    }
}

pub fn short_lease(mut req: ClaimRequest, lease_ms: u64) -> ClaimRequest {
    req.policy.lease = Duration::from_millis(lease_ms);
    req.policy.heartbeat = Duration::from_millis(lease_ms / 3);
    req
}

pub fn token_of(req: &ClaimRequest, outcome: &ClaimOutcome) -> ClaimToken {
    match outcome {
        ClaimOutcome::Claimed {
            run_id, attempt, ..
        } => ClaimToken {
            run_id: *run_id,
            tenant: req.tenant.clone(),
            anfrage: req.anfrage,
            stage: req.stage.clone(),
            attempt: *attempt,
        },
        other => panic!("expected Claimed, got {other:?}"),
    }
}

pub async fn repo(db: &TestDb, pool_size: u32) -> Arc<PgRunRepository> {
    Arc::new(PgRunRepository::new(db.pool(pool_size).await))
}

pub use idemstage_testkit::count;

/// Waits until the database clock has passed the run's lease (no blind sleep: the
/// condition is read from the database).
pub async fn wait_lease_expired(conn: &mut AsyncPgConnection, run_id: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let expired = count(
            conn,
            &format!(
                "SELECT 1 FROM pipeline_runs WHERE id = '{run_id}' AND lease_expires_at < now()"
            ),
        )
        .await;
        if expired == 1 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
