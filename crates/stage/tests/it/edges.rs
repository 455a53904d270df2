//! The promise at its edges (issue 29): an input set back to the one a stage
//! succeeded on never runs it again, a cancelled stage stays cancelled, and a
//! stage reads the input its lineage names, not the newest one. Driven through
//! the executor, as workers would, and checked with the pipeline's own checker.

use std::time::Duration;

use diesel_async::RunQueryDsl;
use idemstage::ops::{self, Actor};
use idemstage_domain::{input_hash_of, InputChangePolicy, SkipReason, StagePolicy};
use idemstage_example::{self as example, check_example_pipeline, Chaos};
use idemstage_stage::{ExecutionOutcome, Pipeline, StageJob};
use idemstage_testkit::count;

use crate::{fixture, Fixture};

const TEXT_1: &str = "10 Stk Schrauben M8";
const TEXT_2: &str = "99 Stk Schrauben M8";

fn policy(max_attempts: i32) -> StagePolicy {
    StagePolicy::default()
        .with_max_attempts(max_attempts)
        .with_on_input_change(InputChangePolicy::Rerun)
        .with_lease(Duration::from_secs(30))
        .with_heartbeat(Duration::from_secs(10))
}

/// Every stage `Rerun` on new input, bodies as `chaos` says.
fn pipeline(chaos: Chaos, max_attempts: i32) -> Pipeline {
    example::pipeline_with(chaos, policy(max_attempts)).unwrap()
}

/// Replaces the item's stored input as `start_in` under `Rerun` does (the
/// same UPDATE), and returns the job that carries it.
pub(crate) async fn set_input(f: &mut Fixture, job: &StageJob, text: &str) -> StageJob {
    let hash = input_hash_of(text.as_bytes());
    diesel::sql_query(format!(
        "UPDATE items SET input_text = '{text}', input_sha256 = '{hash}' WHERE id = '{}'",
        job.item_id
    ))
    .execute(&mut f.conn)
    .await
    .unwrap();
    StageJob {
        input_hash: hash,
        ..job.clone()
    }
}

async fn run(f: &Fixture, pipeline: &Pipeline, stage: &str, job: &StageJob) -> ExecutionOutcome {
    let stage = pipeline.stage(stage).unwrap();
    f.executor().run(pipeline, stage, job).await.unwrap()
}

async fn run_all(f: &Fixture, pipeline: &Pipeline, job: &StageJob) {
    for stage in ["intake", "extract", "feasibility", "calculate"] {
        let outcome = run(f, pipeline, stage, job).await;
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { .. }),
            "{stage}: {outcome:?}"
        );
    }
}

async fn status(f: &mut Fixture, stage: &str) -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        status: String,
    }
    let s: S = diesel::sql_query(format!(
        "SELECT status FROM stage_runs WHERE stage = '{stage}'"
    ))
    .get_result(&mut f.conn)
    .await
    .unwrap();
    s.status
}

async fn cancel(f: &mut Fixture, job: &StageJob) -> ops::CancelOutcome {
    ops::cancel(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &Actor::parse("ops-bot").unwrap(),
    )
    .await
    .unwrap()
}

fn already_succeeded(outcome: &ExecutionOutcome) -> bool {
    matches!(
        outcome,
        ExecutionOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
    )
}

/// Item 1: intake succeeded on text 1, a rerun on text 2 failed once (the run
/// `failed`, its job retrying), the input went back to text 1. The retrying job
/// used to claim the failed run and run intake (and every stage after it) again on
/// text 1: a second success on the same input.
#[tokio::test]
async fn a_retrying_rerun_on_an_input_set_back_does_not_run_again() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 3);
    let job = f.item(TEXT_1).await;
    run_all(&f, &calm, &job).await;

    let changed = set_input(&mut f, &job, TEXT_2).await;
    let crashing = pipeline(Chaos::crashing(1.0), 3);
    let failed = run(&f, &crashing, "intake", &changed).await;
    assert!(
        matches!(failed, ExecutionOutcome::Failed { dead: false, .. }),
        "{failed:?}"
    );
    assert_eq!(status(&mut f, "intake").await, "failed");

    // Back to text 1; the retrying job (re-pointed at text 1 by the send) runs.
    let back = set_input(&mut f, &job, TEXT_1).await;
    let again = run(&f, &calm, "intake", &back).await;
    assert!(already_succeeded(&again), "{again:?}");
    assert_eq!(status(&mut f, "intake").await, "success");
    for stage in ["extract", "feasibility", "calculate"] {
        let outcome = run(&f, &calm, stage, &back).await;
        assert!(already_succeeded(&outcome), "{stage}: {outcome:?}");
    }
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.stages_succeeded, 4);
    // The restored run is on its first success, attempt 1 (text 1, upstream none).
    assert_eq!(
        count(
            &mut f.conn,
            &format!(
                "SELECT 1 FROM stage_runs WHERE stage = 'intake' AND success_attempt = 1
                    AND attempts = 2 AND input_hash = '{}'",
                back.input_hash
            )
        )
        .await,
        1
    );
}

/// Item 1, through the operator: the rerun on text 2 ended `dead`, the input went
/// back to text 1, `retry` revived the dead run, and it used to execute again on
/// the hash of its current success.
#[tokio::test]
async fn an_operator_retry_of_a_dead_rerun_on_an_input_set_back_does_not_run_again() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 1);
    let job = f.item(TEXT_1).await;
    run_all(&f, &calm, &job).await;

    let changed = set_input(&mut f, &job, TEXT_2).await;
    let crashing = pipeline(Chaos::crashing(1.0), 1);
    let dead = run(&f, &crashing, "intake", &changed).await;
    assert!(
        matches!(dead, ExecutionOutcome::Failed { dead: true, .. }),
        "{dead:?}"
    );
    let back = set_input(&mut f, &job, TEXT_1).await;
    ops::retry(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        None,
        &Actor::parse("ops-bot").unwrap(),
        &calm,
    )
    .await
    .unwrap();
    let again = run(&f, &calm, "intake", &back).await;
    assert!(already_succeeded(&again), "{again:?}");
    assert_eq!(status(&mut f, "intake").await, "success");
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.stages_succeeded, 4);
}

/// Item 2: a stage that ran (and failed) before it was cancelled used to come back
/// when its upstream re-ran: the invalidation marked it `stale`, and it succeeded.
#[tokio::test]
async fn a_cancelled_stage_stays_cancelled_when_its_upstream_reruns() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 3);
    let crashing = pipeline(Chaos::crashing(1.0), 3);
    let job = f.item(TEXT_1).await;
    assert!(matches!(
        run(&f, &calm, "intake", &job).await,
        ExecutionOutcome::Succeeded { .. }
    ));
    let failed = run(&f, &crashing, "extract", &job).await;
    assert!(
        matches!(failed, ExecutionOutcome::Failed { .. }),
        "{failed:?}"
    );
    cancel(&mut f, &job).await;
    assert_eq!(status(&mut f, "extract").await, "cancelled");

    // A rerun of intake on new input succeeds and sends extract's job.
    let changed = set_input(&mut f, &job, TEXT_2).await;
    let rerun = run(&f, &calm, "intake", &changed).await;
    assert!(
        matches!(rerun, ExecutionOutcome::Succeeded { .. }),
        "{rerun:?}"
    );
    assert_eq!(status(&mut f, "extract").await, "cancelled");
    let extract = run(&f, &calm, "extract", &changed).await;
    assert!(
        matches!(
            extract,
            ExecutionOutcome::Skipped(SkipReason::Cancelled { .. })
        ),
        "{extract:?}"
    );
    assert_eq!(status(&mut f, "extract").await, "cancelled");
    assert_eq!(
        count(&mut f.conn, "SELECT 1 FROM anfrage_extraktionen").await,
        0
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
}

/// Item 3: intake succeeded on text 1, the input was replaced by text 2, the stages
/// after intake ran before intake's rerun did, and the rerun then died. They used
/// to read text 2 (99 x 1.50) while their lineage names text 1 (10 x 1.50), and the
/// checker saw nothing.
#[tokio::test]
async fn a_downstream_stage_reads_the_input_its_lineage_names() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 1);
    let job = f.item(TEXT_1).await;
    assert!(matches!(
        run(&f, &calm, "intake", &job).await,
        ExecutionOutcome::Succeeded { .. }
    ));
    let changed = set_input(&mut f, &job, TEXT_2).await;
    for stage in ["extract", "feasibility", "calculate"] {
        let outcome = run(&f, &calm, stage, &changed).await;
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { .. }),
            "{stage}: {outcome:?}"
        );
    }
    let crashing = pipeline(Chaos::crashing(1.0), 1);
    let dead = run(&f, &crashing, "intake", &changed).await;
    assert!(
        matches!(dead, ExecutionOutcome::Failed { dead: true, .. }),
        "{dead:?}"
    );
    // 10 x 1.50 = 15.00 EUR, text 1's, as the lineage says.
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM calculation_results WHERE total_cents = 1500"
        )
        .await,
        1
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
}

/// Item 3, the checker: results that do not match the input their run is bound to
/// are reported (they were written here by hand, as a stage reading the newest
/// input used to).
#[tokio::test]
async fn the_checker_reports_results_not_computed_from_the_bound_input() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 1);
    let job = f.item(TEXT_1).await;
    run_all(&f, &calm, &job).await;
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.unbound_results, 0, "{check:?}");
    diesel::sql_query("UPDATE calculation_results SET total_cents = 14850")
        .execute(&mut f.conn)
        .await
        .unwrap();
    diesel::sql_query("UPDATE anfrage_extraktionen SET quantity = 99")
        .execute(&mut f.conn)
        .await
        .unwrap();
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.unbound_results, 2, "{check:?}");
    assert_eq!(check.violations().len(), 1, "{check:?}");
}

/// Item 11: a run created `cancelled` for a queued stage recorded an attempt that
/// finished before it started (the trigger used the transaction's start).
#[tokio::test]
async fn an_attempt_never_finishes_before_it_starts() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 3);
    let job = f.item(TEXT_1).await;
    // Intake succeeds and sends extract's job; extract is only queued.
    assert!(matches!(
        run(&f, &calm, "intake", &job).await,
        ExecutionOutcome::Succeeded { .. }
    ));
    cancel(&mut f, &job).await;
    assert_eq!(status(&mut f, "extract").await, "cancelled");
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_run_attempts WHERE finished_at < started_at"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_run_attempts WHERE finished_at IS NULL"
        )
        .await,
        0
    );
}

/// A cancel right after a rerun on new input was sent (its job queued, not yet
/// claimed) used to cancel only the job: the stage stayed `success` on the old
/// input while the item's stored input was the new one nothing would ever run
/// on. Now the stage ends `cancelled`, as when the rerun is cancelled running, and
/// what it computed stays current.
#[tokio::test]
async fn a_cancel_of_a_queued_rerun_cancels_the_stage_and_keeps_its_results() {
    use diesel_async::AsyncConnection;
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 3);
    let job = f.item(TEXT_1).await;
    run_all(&f, &calm, &job).await;
    let (tenant, item) = (job.tenant_id.clone(), job.item_id);
    f.conn
        .transaction::<_, idemstage_persistence::TxError, _>(async |conn| {
            Ok(idemstage_stage::start_in(conn, &calm, &tenant, &item, TEXT_2).await?)
        })
        .await
        .unwrap();
    let outcome = cancel(&mut f, &job).await;
    let ops::CancelOutcome::Cancelled { stages, jobs, .. } = &outcome else {
        panic!("{outcome:?}")
    };
    // The executor here completes no jobs: the stages' own (same input) jobs are
    // cancelled too, and leave their successes alone.
    assert!(jobs.iter().any(|j| j.queue == "intake"), "{outcome:?}");
    assert_eq!(stages.len(), 1, "{outcome:?}");
    assert_eq!(stages[0].from, ops::CancelledFrom::RerunQueued);
    assert_eq!(status(&mut f, "intake").await, "cancelled");
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'intake' AND success_attempt = 1"
        )
        .await,
        1
    );
    let changed = StageJob {
        input_hash: input_hash_of(TEXT_2.as_bytes()),
        ..job.clone()
    };
    let again = run(&f, &calm, "intake", &changed).await;
    assert!(
        matches!(
            again,
            ExecutionOutcome::Skipped(SkipReason::Cancelled { .. })
        ),
        "{again:?}"
    );
    let check = check_example_pipeline(&mut f.conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.stages_succeeded, 3);
}

/// The soak's find: a rerun on new input whose job was lost before its claim (a
/// job deleted by hand) left the first stage `success` on an input the item no
/// longer holds, and the reconciler counted that as final: the new input never
/// ran. Under `Rerun` it is a pending rerun, and its job is sent again.
#[tokio::test]
async fn the_reconciler_sends_again_a_rerun_whose_job_was_lost() {
    use diesel_async::AsyncConnection;
    let db = idemstage_harness::example::db().await;
    let pool = db.pool(4).await;
    let mut f = fixture().await;
    // The fixture's database is another one: work in `db` only.
    f.conn = db.conn().await;
    let calm = pipeline(Chaos::default(), 3);
    let tenant = idemstage_domain::TenantId::parse("t1").unwrap();
    let item = idemstage_domain::ItemId::new();
    for text in [TEXT_1, TEXT_2] {
        f.conn
            .transaction::<_, idemstage_persistence::TxError, _>(async |conn| {
                Ok(idemstage_stage::start_in(conn, &calm, &tenant, &item, text).await?)
            })
            .await
            .unwrap();
        if text == TEXT_1 {
            // Every stage on text 1, by an executor on this database.
            let repo =
                std::sync::Arc::new(idemstage_persistence::PgRunRepository::new(pool.clone()));
            let exec = idemstage_stage::Executor::new(repo, idemstage_domain::WorkerId::generate());
            let job = StageJob {
                tenant_id: tenant.clone(),
                item_id: item,
                input_hash: input_hash_of(TEXT_1.as_bytes()),
            };
            for stage in calm.stages() {
                let outcome = exec.run(&calm, stage, &job).await.unwrap();
                assert!(
                    matches!(outcome, ExecutionOutcome::Succeeded { .. }),
                    "{outcome:?}"
                );
            }
            diesel::sql_query("DELETE FROM jobs")
                .execute(&mut f.conn)
                .await
                .unwrap();
        }
    }
    // Text 2's intake job is lost.
    diesel::sql_query("DELETE FROM jobs")
        .execute(&mut f.conn)
        .await
        .unwrap();
    let mut reconciler = idemstage_stage::Reconciler::new(calm.clone());
    let report = reconciler.pass(&pool).await.unwrap();
    assert_eq!(report.resent, 1, "{report:?}");
    assert_eq!(
        count(
            &mut f.conn,
            &format!(
                "SELECT 1 FROM job_states WHERE queue = 'intake' AND state = 'created'
                    AND payload->>'input_hash' = '{}'",
                input_hash_of(TEXT_2.as_bytes())
            )
        )
        .await,
        1
    );
}

/// Only the first stage's job carries the input its claim binds: a later stage
/// binds its upstream's success, whatever hash its job names. So a live job of a
/// later stage with another hash is no queued rerun, and a cancel leaves that
/// stage's success alone (it used to end it `cancelled`).
#[tokio::test]
async fn a_cancel_leaves_a_later_stages_success_whose_job_names_another_hash() {
    let mut f = fixture().await;
    let calm = pipeline(Chaos::default(), 3);
    let job = f.item(TEXT_1).await;
    run_all(&f, &calm, &job).await;
    // The executor here completes no jobs: complete them, then send extract's job
    // again naming another hash (as a job written by hand may).
    diesel::sql_query("UPDATE jobs SET state = 'completed'")
        .execute(&mut f.conn)
        .await
        .unwrap();
    let other = StageJob {
        input_hash: input_hash_of(TEXT_2.as_bytes()),
        ..job.clone()
    };
    let extract = calm.job_for(
        &idemstage_domain::StageName::parse("extract").unwrap(),
        &other,
    );
    idemstage_persistence::queue::send_in(&mut f.conn, &extract)
        .await
        .unwrap();
    let outcome = cancel(&mut f, &job).await;
    let ops::CancelOutcome::Cancelled { stages, jobs, .. } = &outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(jobs.len(), 1, "{outcome:?}");
    assert!(stages.is_empty(), "{outcome:?}");
    assert_eq!(status(&mut f, "extract").await, "success");
}
