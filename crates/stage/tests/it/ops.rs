//! Operator commands with real stage workers: a dead stage retried by the
//! operator is run by a worker to success, through the normal claim.

use std::sync::Arc;

use idemstage::ops::{self, Actor, RetryOutcome};
use idemstage_domain::{ItemId, StagePolicy, TenantId};
use idemstage_example::{self as example, Chaos};
use idemstage_harness::example::{
    assert_quiet_and_sound, send, start_pipeline_worker, stop_pipeline_worker, text, wait_until,
};

#[tokio::test]
async fn a_dead_stage_retried_by_the_operator_is_run_to_success_by_a_worker() {
    let db = idemstage_harness::example::db().await;
    let pool = db.pool(8).await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    send(&mut conn, &tenant, item, &text(1)).await;

    // Every body crashes and a stage has one attempt: intake dies.
    let policy = StagePolicy::default().with_max_attempts(1);
    let crashing = example::pipeline_with(Chaos::crashing(1.0), policy).unwrap();
    let counters = Arc::new(idemstage::worker::Counters::default());
    let worker = start_pipeline_worker(pool.clone(), db.url(), crashing, 2, counters.clone());
    let dead = wait_until(db.url(), "intake dead, no live job", 60, |c| {
        c.runs_by_status.get("dead") == Some(&1) && c.live_jobs == 0
    })
    .await;
    stop_pipeline_worker(worker).await;
    assert_eq!(dead.stages_succeeded, 0, "{dead:?}");

    // The operator retries it (the pipeline the workers run now knows the budget).
    let pipeline = idemstage_harness::example::pipeline();
    let outcome = ops::retry(
        &mut conn,
        &tenant,
        &item,
        None,
        &Actor::parse("ops-bot").unwrap(),
        &pipeline,
    )
    .await
    .unwrap();
    let RetryOutcome::Retried { stages } = &outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(stages.len(), 1);
    assert_eq!(stages[0].stage.as_str(), "intake");

    let worker = start_pipeline_worker(pool, db.url(), pipeline, 2, counters);
    let check = assert_quiet_and_sound(db.url(), 60).await;
    stop_pipeline_worker(worker).await;
    assert_eq!(check.stages_succeeded, 4, "{check:?}");
    assert_eq!(check.runs_by_status.get("dead"), None, "{check:?}");
    // Attempt 1 died, attempt 2 succeeded: the fencing token went on growing.
    let history = idemstage_testkit::count(
        &mut conn,
        &format!(
            "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id \
              WHERE r.item_id = '{item}' AND r.stage = 'intake' \
                AND ((a.attempt = 1 AND a.outcome = 'failed') \
                  OR (a.attempt = 2 AND a.outcome = 'success'))"
        ),
    )
    .await;
    assert_eq!(history, 2);
}
