//! A stage body that is told to wait (`StageError::RateLimited`, an HTTP 429 with
//! Retry-After): the attempt is given back without using the stage's budget, and
//! the stage's bucket is held so its other jobs wait too.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemstage_domain::{StageError, StagePolicy};
use idemstage_persistence::{queue, FencedTx};
use idemstage_stage::{Done, ExecutionOutcome, Pipeline, PrepareContext, Stage};
use idemstage_testkit::count;

use crate::fixture;

struct Limited {
    policy: StagePolicy,
    calls: AtomicUsize,
}

#[async_trait]
impl Stage for Limited {
    const NAME: &'static str = "limited";
    type Input = ();
    type Prepared = ();
    type Output = ();
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        // The first call hears 429 Retry-After: 30.
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(StageError::RateLimited {
                retry_after: Duration::from_secs(30),
            });
        }
        Ok(())
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        tx.audit("limited", "limited.done", serde_json::json!({}))
            .await?;
        Ok(Done::next(()))
    }
}

#[tokio::test]
async fn a_rate_limited_attempt_keeps_the_budget_and_holds_the_stages_bucket() {
    let mut f = fixture().await;
    let stage = Arc::new(Limited {
        policy: StagePolicy::default().with_max_attempts(2),
        calls: AtomicUsize::new(0),
    });
    let pipeline = Pipeline::builder(stage.clone()).build().unwrap();
    let job = f.item("1 Stk Anruf").await;
    let exec = f.executor();

    let outcome = exec
        .run(&pipeline, pipeline.first_stage(), &job)
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            ExecutionOutcome::RateLimited { attempt: 1, retry_after } if retry_after == Duration::from_secs(30)
        ),
        "{outcome:?}"
    );
    // Both attempts of the budget are still there.
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'limited' AND max_attempts - attempts = 2"
        )
        .await,
        1
    );
    // No per-tenant rate on the stage: the stage's own bucket is held, ~30 s.
    assert!(queue::held_until(&mut f.conn, "limited", None)
        .await
        .unwrap()
        .is_some());
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM queue_buckets WHERE queue = 'limited' AND tenant_id = '' \
               AND held_until BETWEEN clock_timestamp() + interval '25 s' \
                                  AND clock_timestamp() + interval '30 s'"
        )
        .await,
        1
    );

    let outcome = exec
        .run(&pipeline, pipeline.first_stage(), &job)
        .await
        .unwrap();
    assert!(
        matches!(outcome, ExecutionOutcome::Succeeded { attempt: 2, .. }),
        "{outcome:?}"
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id \
              WHERE r.stage = 'limited' AND a.attempt = 1 AND a.outcome = 'abandoned'"
        )
        .await,
        1
    );
}
