//! What the tests share: a database with the core's and this pipeline's
//! migrations, executors, starting items as `idemstage::pipeline::start` does, reading
//! the team's tables as the superuser (no row-level security), and stage
//! wrappers that hold an execution at a point of the test's choosing.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use diesel::prelude::*;
use idemstage::diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage::{
    async_trait, db::PgPool, fenced::FencedTx, ids::ItemId, ids::TenantId, ids::WorkerId,
    items::RegisterOutcome, pipeline::start, pipeline::Pipeline, runs::PgRunRepository,
    stage::Done, stage::Executor, stage::PrepareContext, stage::Stage, stage::StageError,
    stage::StageJob, stage::StagePolicy,
};
use idemstage_testkit::TestDb;
use ocr_translate::schema::{ocr_pages, translations};
use tokio::sync::Notify;

pub use idemstage_testkit::count;

pub struct Fixture {
    pub db: TestDb,
    pub pool: PgPool,
    /// The test's own session (superuser: it sees every tenant's rows).
    pub conn: AsyncPgConnection,
}

pub async fn fixture() -> Fixture {
    let db = TestDb::with_migrations(vec![ocr_translate::MIGRATIONS]).await;
    let pool = db.pool(8).await;
    let conn = db.conn().await;
    Fixture { db, pool, conn }
}

pub fn tenant(slug: &str) -> TenantId {
    TenantId::parse(slug).unwrap()
}

impl Fixture {
    /// An executor of its own worker identity.
    pub fn executor(&self) -> Executor {
        Executor::new(
            Arc::new(PgRunRepository::new(self.pool.clone())),
            WorkerId::generate(),
        )
    }

    /// `idemstage::pipeline::start`: registers (or, under ocr's `Rerun` policy, replaces) the
    /// input and sends the first job; returns the job that carries the stored hash
    /// and what the registration did.
    pub async fn start(
        &self,
        pipeline: &Pipeline,
        tenant: &TenantId,
        item: &ItemId,
        text: &str,
    ) -> (StageJob, RegisterOutcome) {
        let started = start(&self.pool, pipeline, tenant, item, text)
            .await
            .unwrap();
        let job = StageJob {
            tenant_id: tenant.clone(),
            item_id: *item,
            input_hash: started.registered.input_sha256().to_owned(),
        };
        (job, started.registered)
    }

    /// A new item of `tenant`, started.
    pub async fn item(&self, pipeline: &Pipeline, tenant: &TenantId, text: &str) -> StageJob {
        self.start(pipeline, tenant, &ItemId::new(), text).await.0
    }

    /// The item's pages as stored, each with ocr's last successful attempt
    /// (the core's record; see [`Fixture::success_attempt`]): (page, text,
    /// attempt).
    pub async fn pages(&mut self, job: &StageJob) -> Vec<(i32, String, i32)> {
        use ocr_pages::dsl as p;
        let attempt = self.success_attempt(job, ocr_translate::OCR).await;
        let rows: Vec<(i32, String)> = p::ocr_pages
            .filter(p::tenant_id.eq(job.tenant_id.as_str()))
            .filter(p::item_id.eq(job.item_id.to_string()))
            .order(p::page)
            .select((p::page, p::text))
            .load(&mut self.conn)
            .await
            .unwrap();
        rows.into_iter()
            .map(|(page, text)| (page, text, attempt.0))
            .collect()
    }

    /// The last attempt of the item's run of `stage` that succeeded, and the
    /// upstream attempt it read (the core's record, `stage_run_attempts`): the
    /// attempt whose rows the team's tables hold, since only a success commits
    /// any. (0, 0) for none.
    pub async fn success_attempt(&mut self, job: &StageJob, stage: &str) -> (i32, i32) {
        #[derive(QueryableByName)]
        struct Attempts {
            #[diesel(sql_type = diesel::sql_types::Integer)]
            success: i32,
            #[diesel(sql_type = diesel::sql_types::Integer)]
            upstream: i32,
        }
        let found: Option<Attempts> = diesel::sql_query(
            "SELECT a.attempt AS success, COALESCE(a.upstream_attempt, 0) AS upstream
               FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id
              WHERE r.tenant_id = $1 AND r.item_id = $2 AND r.stage = $3
                AND a.outcome = 'success'
              ORDER BY a.attempt DESC LIMIT 1",
        )
        .bind::<diesel::sql_types::Text, _>(job.tenant_id.as_str())
        .bind::<diesel::sql_types::Text, _>(job.item_id.to_string())
        .bind::<diesel::sql_types::Text, _>(stage)
        .get_result(&mut self.conn)
        .await
        .optional()
        .unwrap();
        found.map_or((0, 0), |a| (a.success, a.upstream))
    }

    /// The item's page ids as stored.
    pub async fn page_ids(&mut self, job: &StageJob) -> Vec<String> {
        use ocr_pages::dsl as p;
        p::ocr_pages
            .filter(p::item_id.eq(job.item_id.to_string()))
            .select(p::id)
            .load(&mut self.conn)
            .await
            .unwrap()
    }

    /// The item's translations as stored, each with translate's last
    /// successful attempt and the ocr attempt it read (the core's record; see
    /// [`Fixture::success_attempt`]): (page, text, attempt, ocr_attempt).
    pub async fn translations(&mut self, job: &StageJob) -> Vec<(i32, String, i32, i32)> {
        use translations::dsl as t;
        let (attempt, ocr_attempt) = self.success_attempt(job, ocr_translate::TRANSLATE).await;
        let rows: Vec<(i32, String)> = t::translations
            .filter(t::tenant_id.eq(job.tenant_id.as_str()))
            .filter(t::item_id.eq(job.item_id.to_string()))
            .order(t::page)
            .select((t::page, t::text))
            .load(&mut self.conn)
            .await
            .unwrap();
        rows.into_iter()
            .map(|(page, text)| (page, text, attempt, ocr_attempt))
            .collect()
    }

    /// The status of the item's run of `stage`.
    pub async fn status(&mut self, job: &StageJob, stage: &str) -> String {
        #[derive(QueryableByName)]
        struct Status {
            #[diesel(sql_type = diesel::sql_types::Text)]
            status: String,
        }
        diesel::sql_query("SELECT status FROM stage_runs WHERE item_id = $1 AND stage = $2")
            .bind::<diesel::sql_types::Text, _>(job.item_id.to_string())
            .bind::<diesel::sql_types::Text, _>(stage)
            .get_result::<Status>(&mut self.conn)
            .await
            .unwrap()
            .status
    }

    /// `SELECT count(*)` of `sql` with `{item}` replaced by the job's item.
    pub async fn count_for(&mut self, job: &StageJob, sql: &str) -> i64 {
        count(
            &mut self.conn,
            &sql.replace("{item}", &job.item_id.to_string()),
        )
        .await
    }
}

/// The pages `texts` as stored by `attempt`, numbered from 1.
pub fn expected_pages(texts: &[&str], attempt: i32) -> Vec<(i32, String, i32)> {
    texts
        .iter()
        .zip(1..)
        .map(|(t, page)| (page, t.to_string(), attempt))
        .collect()
}

/// The translations of the pages `texts`, by `attempt` from `ocr_attempt`.
pub fn expected_translations(
    texts: &[&str],
    attempt: i32,
    ocr_attempt: i32,
) -> Vec<(i32, String, i32, i32)> {
    texts
        .iter()
        .zip(1..)
        .map(|(t, page)| (page, ocr_translate::translate_text(t), attempt, ocr_attempt))
        .collect()
}

/// A stage wrapper: the first execution waits in `prepare` (after its claim,
/// outside any transaction, its lease renewed) until the test lets it go; the
/// others pass. Counts the bodies that ran.
pub struct HeldOnce<S> {
    inner: S,
    held: AtomicBool,
    pub hold: Hold,
}

/// The test's side of a [`HeldOnce`], whatever stage it wraps.
pub struct Hold {
    pub started: Notify,
    pub release: Notify,
    bodies: AtomicUsize,
}

impl<S: Stage> HeldOnce<S> {
    pub fn new(inner: S) -> Arc<Self> {
        Arc::new(Self {
            inner,
            held: AtomicBool::new(false),
            hold: Hold {
                started: Notify::new(),
                release: Notify::new(),
                bodies: AtomicUsize::new(0),
            },
        })
    }
}

impl Hold {
    /// How many bodies ran (a method: diesel-async's `RunQueryDsl::load` would
    /// shadow the atomic's).
    pub fn bodies(&self) -> usize {
        AtomicUsize::load(&self.bodies, Ordering::SeqCst)
    }
}

#[async_trait]
impl<S: Stage> Stage for HeldOnce<S> {
    const NAME: &'static str = S::NAME;
    type Input = S::Input;
    type Prepared = S::Prepared;
    type Output = S::Output;
    fn policy(&self) -> StagePolicy {
        self.inner.policy()
    }
    async fn prepare(&self, ctx: &PrepareContext<'_, S::Input>) -> Result<S::Prepared, StageError> {
        if !self.held.swap(true, Ordering::SeqCst) {
            self.hold.started.notify_one();
            self.hold.release.notified().await;
        }
        self.inner.prepare(ctx).await
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        input: &S::Input,
        prepared: &S::Prepared,
    ) -> Result<Done<S::Output>, StageError> {
        self.hold.bodies.fetch_add(1, Ordering::SeqCst);
        self.inner.commit(tx, input, prepared).await
    }
}

/// A stage wrapper: the first transaction, after the inner stage's writes, notes
/// the page ids it sees and then sleeps in the database (`pg_sleep`), so that the
/// test can kill its connection mid-transaction.
pub struct SleepsAfterWritesOnce<S> {
    inner: S,
    slept: AtomicBool,
    pub sleeping: Notify,
    pub ids_seen: std::sync::Mutex<Vec<String>>,
}

impl<S: Stage> SleepsAfterWritesOnce<S> {
    pub fn new(inner: S) -> Arc<Self> {
        Arc::new(Self {
            inner,
            slept: AtomicBool::new(false),
            sleeping: Notify::new(),
            ids_seen: Default::default(),
        })
    }
}

#[async_trait]
impl<S: Stage> Stage for SleepsAfterWritesOnce<S> {
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
        let flow = self.inner.commit(tx, input, prepared).await?;
        if !self.slept.swap(true, Ordering::SeqCst) {
            use ocr_pages::dsl as p;
            let ids: Vec<String> = p::ocr_pages
                .select(p::id)
                .load(tx.conn())
                .await
                .map_err(|e| StageError::Repo(idemstage::db::map_diesel_error(e)))?;
            *self.ids_seen.lock().unwrap() = ids;
            self.sleeping.notify_one();
            diesel::sql_query("SELECT pg_sleep(60)")
                .execute(tx.conn())
                .await
                .map_err(|e| StageError::Repo(idemstage::db::map_diesel_error(e)))?;
        }
        Ok(flow)
    }
}
