//! Helpers shared by this binary's tests.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use idemstage_domain::{
    ClaimOutcome, ClaimRequest, ClaimToken, ItemId, StageError, StageName, StagePolicy, TenantId,
    WorkerId,
};
use idemstage_persistence::items::register_item;
use idemstage_persistence::{FencedTx, PgRunRepository};
use idemstage_testkit::TestDb;

/// The input `new_item` registers, and another one to replace it with.
pub const TEXT_A: &str = "10 Stk Schrauben M8";
pub const TEXT_B: &str = "20 m Kabel NYM";

pub fn hash_a() -> String {
    idemstage_domain::input_hash_of(TEXT_A.as_bytes())
}

pub fn hash_b() -> String {
    idemstage_domain::input_hash_of(TEXT_B.as_bytes())
}

/// Replaces an item's stored input by hand (as the connecting user), as a
/// rerun with new input does.
pub async fn replace_input(conn: &mut AsyncPgConnection, item: ItemId, text: &str) {
    use diesel::sql_types::Text;
    use diesel_async::RunQueryDsl;
    diesel::sql_query("UPDATE items SET input_text = $2, input_sha256 = $3 WHERE id = $1")
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(text)
        .bind::<Text, _>(idemstage_domain::input_hash_of(text.as_bytes()))
        .execute(conn)
        .await
        .unwrap();
}

pub fn tenant(s: &str) -> TenantId {
    TenantId::parse(s).unwrap()
}

pub fn stage(s: &str) -> StageName {
    StageName::parse(s).unwrap()
}

pub async fn new_item(conn: &mut AsyncPgConnection, tenant: &TenantId) -> ItemId {
    let id = ItemId::new();
    register_item(conn, tenant, &id, TEXT_A).await.unwrap();
    id
}

pub fn request(tenant: &TenantId, item: ItemId, stage_name: &str) -> ClaimRequest {
    ClaimRequest {
        tenant: tenant.clone(),
        item,
        stage: stage(stage_name),
        input_hash: hash_a(),
        worker: WorkerId::generate(),
        policy: StagePolicy::default(),
        upstream: None,
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
            item: req.item,
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
            &format!("SELECT 1 FROM stage_runs WHERE id = '{run_id}' AND lease_expires_at < now()"),
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

/// Pins a closure to the higher-ranked `FencedWrite` signature.
pub fn write_fn<F>(f: F) -> F
where
    F: for<'t> Fn(&'t mut FencedTx<'_>) -> BoxFuture<'t, Result<(), StageError>> + Send + Sync,
{
    f
}

/// A stage body that writes nothing.
pub fn noop<'t>(_: &'t mut FencedTx<'_>) -> BoxFuture<'t, Result<(), StageError>> {
    async { Ok(()) }.boxed()
}

#[derive(diesel::QueryableByName)]
struct Stat {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// What `sql` did by the statistics expression `stat` (e.g.
/// `pg_stat_get_xact_tuples_returned(…)`), read before and after it inside
/// one transaction (the statistics are not sent in between).
pub async fn stat_around(conn: &mut AsyncPgConnection, stat: &str, sql: String) -> i64 {
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        let read = || diesel::sql_query(format!("SELECT ({stat})::bigint AS n"));
        let before: Stat = read().get_result(conn).await?;
        diesel::sql_query(sql).execute(conn).await?;
        let after: Stat = read().get_result(conn).await?;
        Ok(after.n - before.n)
    })
    .await
    .unwrap()
}
