//! One stage of a team's pipeline, run in process against a test database.

use std::sync::Arc;

use idemstage::{
    db::RepoError, ids::ItemId, ids::TenantId, ids::WorkerId, pipeline::Pipeline,
    runs::PgRunRepository, stage::ExecutionOutcome, stage::Executor, stage::StageJob,
};

use crate::TestDb;

/// Runs the stage named `stage` of `pipeline` once for `job` against `db`, as a
/// worker would (claim, `prepare`, `commit` in the fenced transaction, hand-off
/// to the next stage), in process and without the queue, and returns its
/// outcome. Panics if the pipeline has no such stage.
///
/// ```no_run
/// # async fn demo(pipeline: idemstage::pipeline::Pipeline, db: idemstage_testkit::TestDb) {
/// let tenant = idemstage::ids::TenantId::parse("acme").unwrap();
/// let job = idemstage_testkit::item_job(&db, &pipeline, &tenant, "scan of page 1").await;
/// let outcome = idemstage_testkit::run_stage(&db, &pipeline, "ocr", &job).await.unwrap();
/// assert!(matches!(outcome, idemstage::stage::ExecutionOutcome::Succeeded { .. }));
/// # }
/// ```
pub async fn run_stage(
    db: &TestDb,
    pipeline: &Pipeline,
    stage: &str,
    job: &StageJob,
) -> Result<ExecutionOutcome, RepoError> {
    let stage = pipeline
        .stage(stage)
        .unwrap_or_else(|e| panic!("run_stage: {e}"));
    let repo = Arc::new(PgRunRepository::new(db.pool(2).await));
    Executor::new(repo, WorkerId::generate())
        .run(pipeline, stage, job)
        .await
}

/// Registers a new item of `tenant` with `input` in `db` (no job sent) and
/// returns the job of `pipeline`'s first stage for it, for [`run_stage`] (a later
/// stage's job for the same item is the same).
pub async fn item_job(
    db: &TestDb,
    pipeline: &Pipeline,
    tenant: &TenantId,
    input: &str,
) -> StageJob {
    let item = ItemId::new();
    let mut conn = db.conn().await;
    let registered = idemstage::items::register_item(&mut conn, tenant, &item, input)
        .await
        .expect("register the item");
    let _ = pipeline;
    StageJob {
        tenant_id: tenant.clone(),
        item_id: item,
        input_hash: registered.input_sha256().to_owned(),
    }
}
