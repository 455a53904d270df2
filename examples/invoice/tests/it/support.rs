//! What the tests share: a database, an executor, starting an item, running
//! every stage in order, counting rows as the superuser, and stage wrappers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use idemstage::diesel::sql_types::BigInt;
use idemstage::diesel::QueryableByName;
use idemstage::diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::prelude::*;
use idemstage::{
    db::PgPool, ids::WorkerId, runs::PgRunRepository, stage::ExecutionOutcome, stage::Executor,
    stage::StageJob,
};
use idemstage_testkit::TestDb;
use tokio::sync::Notify;

pub struct Fixture {
    pub _db: TestDb,
    pub pool: PgPool,
    /// The test's own session (superuser: it sees every tenant's rows).
    pub conn: AsyncPgConnection,
    pub executor: Executor,
}

pub async fn fixture() -> Fixture {
    let db = TestDb::with_migrations(vec![invoice_pipeline::MIGRATIONS]).await;
    let pool = db.pool(8).await;
    let conn = db.conn().await;
    let executor = Executor::new(
        Arc::new(PgRunRepository::new(pool.clone())),
        WorkerId::generate(),
    );
    Fixture {
        _db: db,
        pool,
        conn,
        executor,
    }
}

pub fn tenant(slug: &str) -> TenantId {
    TenantId::parse(slug).unwrap()
}

/// An invoice of `vendor` with two lines (total 5.00 + 3 × 12.50 = 42.50).
pub fn invoice_text(vendor: &str, number: &str) -> String {
    format!(
        "vendor: {vendor}\nnumber: {number}\nline: Schrauben | 100 | 0.05\nline: Muttern | 3 | 12.50\n"
    )
}

impl Fixture {
    /// `idemstage::pipeline::start`, and the job it sent.
    pub async fn start(
        &self,
        pipeline: &Pipeline,
        tenant: &TenantId,
        item: &ItemId,
        text: &str,
    ) -> (StageJob, idemstage::items::StartOutcome) {
        let started = start(&self.pool, pipeline, tenant, item, text)
            .await
            .unwrap();
        let job = StageJob {
            tenant_id: tenant.clone(),
            item_id: *item,
            input_hash: started.registered.input_sha256().to_owned(),
        };
        (job, started)
    }

    /// Runs the stage named `stage` once.
    pub async fn run(&self, pipeline: &Pipeline, stage: &str, job: &StageJob) -> ExecutionOutcome {
        let stage = pipeline
            .stages()
            .iter()
            .find(|s| s.name().as_str() == stage)
            .unwrap();
        self.executor.run(pipeline, stage, job).await.unwrap()
    }

    /// Runs every stage in order; each must succeed.
    pub async fn run_all(&self, pipeline: &Pipeline, job: &StageJob) {
        for stage in pipeline.stages() {
            let outcome = self.executor.run(pipeline, stage, job).await.unwrap();
            assert!(
                matches!(outcome, ExecutionOutcome::Succeeded { .. }),
                "{}: {outcome:?}",
                stage.name()
            );
        }
    }

    /// `SELECT count(*) FROM (sql)`.
    pub async fn count(&mut self, sql: &str) -> i64 {
        #[derive(QueryableByName)]
        struct Count {
            #[diesel(sql_type = BigInt)]
            n: i64,
        }
        idemstage::diesel::sql_query(format!("SELECT count(*) AS n FROM ({sql}) q"))
            .get_result::<Count>(&mut self.conn)
            .await
            .unwrap()
            .n
    }
}

/// A stage wrapper whose first commit does the inner stage's writes, then fails
/// transiently (so they roll back).
pub struct FailsCommitOnce<S> {
    pub inner: S,
    failed: AtomicBool,
}

impl<S> FailsCommitOnce<S> {
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            failed: AtomicBool::new(false),
        }
    }
}

#[async_trait]
impl<S: Stage> Stage for FailsCommitOnce<S> {
    const NAME: &'static str = S::NAME;
    type Input = S::Input;
    type Prepared = S::Prepared;
    type Output = S::Output;
    fn policy(&self) -> StagePolicy {
        self.inner.policy()
    }
    async fn prepare(&self, ctx: &PrepareContext<'_, S::Input>) -> Result<S::Prepared, StageError> {
        self.inner.prepare(ctx).await
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &S::Input,
        prepared: &S::Prepared,
    ) -> Result<Done<S::Output>, StageError> {
        let done = self.inner.commit(tx, input, prepared).await?;
        if !self.failed.swap(true, Ordering::SeqCst) {
            return Err(StageError::Transient("injected: commit failed once".into()));
        }
        Ok(done)
    }
}

/// A stage wrapper that records the input every `prepare` got, and holds the
/// first one (claimed, outside any transaction) until the test releases it.
pub struct Recorded<S: Stage> {
    inner: S,
    held: AtomicBool,
    pub started: Notify,
    pub release: Notify,
    pub inputs: Mutex<Vec<S::Input>>,
}

impl<S: Stage> Recorded<S>
where
    S::Input: Clone,
{
    pub fn new(inner: S) -> Arc<Self> {
        Arc::new(Self {
            inner,
            held: AtomicBool::new(false),
            started: Notify::new(),
            release: Notify::new(),
            inputs: Mutex::new(Vec::new()),
        })
    }
}

#[async_trait]
impl<S: Stage> Stage for Recorded<S>
where
    S::Input: Clone,
{
    const NAME: &'static str = S::NAME;
    type Input = S::Input;
    type Prepared = S::Prepared;
    type Output = S::Output;
    fn policy(&self) -> StagePolicy {
        self.inner.policy()
    }
    async fn prepare(&self, ctx: &PrepareContext<'_, S::Input>) -> Result<S::Prepared, StageError> {
        self.inputs.lock().unwrap().push(ctx.input().clone());
        if !self.held.swap(true, Ordering::SeqCst) {
            self.started.notify_one();
            self.release.notified().await;
        }
        self.inner.prepare(ctx).await
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &S::Input,
        prepared: &S::Prepared,
    ) -> Result<Done<S::Output>, StageError> {
        self.inner.commit(tx, input, prepared).await
    }
}
