//! A stage worker stopping while a stage is still running: after the grace the
//! execution is aborted, and the stage is given back at once, not left `running`
//! until its lease runs out.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemstage_domain::{
    ClaimOutcome, ClaimRequest, ItemId, StageError, StageName, StagePolicy, TenantId, WorkerId,
};
use idemstage_persistence::items::register_item;
use idemstage_persistence::{queue, FencedTx, PgRunRepository};
use idemstage_runner::{Counters, PipelineWorker, PipelineWorkerConfig};
use idemstage_stage::{first_job, Done, Pipeline, PrepareContext, Stage, StageRef};
use idemstage_testkit::TestDb;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::support::count;

/// Never finishes `prepare`; says when it started.
struct Stuck {
    policy: StagePolicy,
    started: Arc<Notify>,
}

#[async_trait]
impl Stage for Stuck {
    const NAME: &'static str = "unnamed";
    type Input = ();
    type Prepared = ();
    type Output = ();
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(&self, _job: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        self.started.notify_one();
        std::future::pending().await
    }
    async fn commit(&self, _tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        Ok(Done::next(()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_aborted_at_shutdown_is_released_at_once() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // A lease far longer than the test: only a release can end it early.
    let policy = StagePolicy::default()
        .with_lease(Duration::from_secs(600))
        .with_heartbeat(Duration::from_secs(60))
        .with_timeout(Duration::from_secs(600));
    let started = Arc::new(Notify::new());
    let pipeline = Pipeline::new(vec![StageRef::named(
        "stuck",
        Stuck {
            policy: policy.clone(),
            started: started.clone(),
        },
    )
    .unwrap()])
    .unwrap();
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    let registered = register_item(&mut conn, &tenant, &item, "1 h Warten")
        .await
        .unwrap();
    let input_hash = registered.input_sha256().to_owned();
    let job = first_job(&pipeline, tenant.clone(), item, input_hash.clone());
    queue::send_in(&mut conn, &job).await.unwrap();

    let mut config = PipelineWorkerConfig::default().with_concurrency(1);
    config.queue.poll_interval = Duration::from_millis(100);
    config.queue.shutdown_grace = Duration::from_millis(100);
    let worker = PipelineWorker::new(
        db.pool(4).await,
        db.url(),
        pipeline.clone(),
        config,
        Arc::new(Counters::default()),
    )
    .unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    tokio::time::timeout(Duration::from_secs(60), started.notified())
        .await
        .expect("the stage never started");
    stop.cancel();
    let stats = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("worker did not stop")
        .unwrap();
    assert_eq!(stats.released, 1, "{stats:?}");

    // Released when run() returned: the lease ended, the attempt is abandoned and
    // given back (max_attempts one higher), the job is queued again.
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs r JOIN stage_run_attempts a ON a.run_id = r.id
              WHERE r.status = 'running' AND r.lease_expires_at <= now()
                AND r.max_attempts = 6 AND a.attempt = 1 AND a.outcome = 'abandoned'"
        )
        .await,
        1
    );
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM job_states WHERE state = 'retry'").await,
        1
    );
    // So another worker claims the stage now, not after ten minutes.
    let repo = PgRunRepository::new(db.pool(2).await);
    let claim = repo
        .claim(&ClaimRequest {
            tenant,
            item,
            stage: StageName::parse("stuck").unwrap(),
            input_hash,
            worker: WorkerId::generate(),
            policy,
            upstream: None,
        })
        .await
        .unwrap();
    assert!(
        matches!(claim, ClaimOutcome::Claimed { attempt: 2, .. }),
        "{claim:?}"
    );
}
