//! Issue 29, item 5, through a stage worker: a stage interrupted by the database
//! on every attempt is deferred a bounded number of times, then its attempts
//! count, and it ends `dead` with its reason and its job failed, not deferred for
//! ever.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use diesel_async::RunQueryDsl;
use idemstage_domain::{input_hash_of, ItemId, StageError, StagePolicy, TenantId};
use idemstage_persistence::items::register_item;
use idemstage_persistence::{map_diesel_error, FencedTx};
use idemstage_runner::Counters;
use idemstage_stage::{first_job, Done, Pipeline, PrepareContext, Stage, StageRef};

use crate::support::{count, start_pipeline_worker, stop_pipeline_worker};

/// Hits a statement timeout (57014, retryable: an interruption) on every attempt.
struct AlwaysInterrupted {
    policy: StagePolicy,
}

#[async_trait]
impl Stage for AlwaysInterrupted {
    const NAME: &'static str = "unnamed";
    type Input = ();
    type Prepared = ();
    type Output = ();
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        Ok(())
    }
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        diesel::sql_query("SET LOCAL statement_timeout = '20ms'")
            .execute(tx.conn())
            .await
            .map_err(map_diesel_error)?;
        diesel::sql_query("SELECT pg_sleep(1)")
            .execute(tx.conn())
            .await
            .map_err(map_diesel_error)?;
        Ok(Done::next(()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_interrupted_every_time_ends_dead_and_its_job_failed() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let pipeline = Pipeline::new(vec![StageRef::named(
        "flaky",
        AlwaysInterrupted {
            policy: StagePolicy::default()
                .with_max_attempts(2)
                .with_max_interruptions(2),
        },
    )
    .unwrap()])
    .unwrap();
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    register_item(&mut conn, &tenant, &item, "x").await.unwrap();
    let job = first_job(&pipeline, tenant, item, input_hash_of(b"x"));
    idemstage_persistence::queue::send_in(&mut conn, &job)
        .await
        .unwrap();
    let worker = start_pipeline_worker(
        db.pool(4).await,
        db.url(),
        pipeline,
        2,
        Arc::new(Counters::default()),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(&mut conn, "SELECT 1 FROM job_states WHERE state = 'failed'").await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stage is still being retried"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_pipeline_worker(worker).await;
    // 2 given back, the third counted; again for the second attempt of the budget.
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs
              WHERE stage = 'flaky' AND status = 'dead' AND attempts = 6
                AND last_error LIKE '%statement timeout%counted after 2 interruptions in a row%'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT outcome FROM stage_run_attempts GROUP BY outcome
             HAVING (outcome = 'abandoned' AND count(*) = 4)
                 OR (outcome = 'failed' AND count(*) = 2)"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM job_states WHERE state <> 'failed'"
        )
        .await,
        0
    );
}
