//! Executor tests against a real PostgreSQL: the example pipeline by hand (no
//! worker), panics, timeouts, lease renewal, transactional hand-off.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    ClaimOutcome, ClaimRequest, ItemId, SkipReason, StageError, StageName, StagePolicy, TenantId,
    WorkerId,
};
use idemstage_example::{self as example, Chaos};
use idemstage_persistence::items::register_item;
use idemstage_persistence::{queue, FencedTx, PgRunRepository};
use idemstage_stage::{
    first_job, Done, ExecutionOutcome, Executor, JobLease, Pipeline, PrepareContext, Stage,
    StageJob, StageRef,
};
use idemstage_testkit::TestDb;
use tokio::sync::Notify;

use idemstage_testkit::count;

mod contract;
mod edges;
mod fan_out;
mod interruptions;
mod large_writes;
mod lineage;
mod ops;
mod quantities;
mod rate_limited;
mod waits;

pub(crate) struct Fixture {
    _db: TestDb,
    repo: Arc<PgRunRepository>,
    pub(crate) conn: AsyncPgConnection,
}

pub(crate) async fn fixture() -> Fixture {
    let db = idemstage_harness::example::db().await;
    let repo = Arc::new(PgRunRepository::new(db.pool(8).await));
    let conn = db.conn().await;
    Fixture {
        _db: db,
        repo,
        conn,
    }
}

impl Fixture {
    pub(crate) async fn item(&mut self, text: &str) -> StageJob {
        let tenant = TenantId::parse("t1").unwrap();
        let item = ItemId::new();
        let registered = register_item(&mut self.conn, &tenant, &item, text)
            .await
            .unwrap();
        StageJob {
            tenant_id: tenant,
            item_id: item,
            input_hash: registered.input_sha256().to_owned(),
        }
    }

    pub(crate) fn executor(&self) -> Executor {
        Executor::new(self.repo.clone(), WorkerId::generate())
    }
}

#[tokio::test]
async fn the_example_pipeline_runs_stage_by_stage_and_hands_off_in_the_same_transaction() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let job = f
        .item("10 Stk Schrauben M8\n2,5 m Kabel NYM\n1 h Montage")
        .await;
    let exec = f.executor();
    for stage in pipeline.stages() {
        let outcome = exec.run(&pipeline, stage, &job).await.unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { attempt: 1, .. }),
            "{}: {outcome:?}",
            stage.name()
        );
    }
    let c = &mut f.conn;
    assert_eq!(count(c, "SELECT * FROM dateien").await, 1);
    assert_eq!(count(c, "SELECT * FROM anfrage_extraktionen").await, 3);
    assert_eq!(
        count(c, "SELECT * FROM feasibility_results WHERE feasible").await,
        1
    );
    // 10 × 1.50 + 2.5 × 3.20 + 1 × 65.00 = 88.00 EUR
    assert_eq!(
        count(
            c,
            "SELECT * FROM calculation_results WHERE total_cents = 8800"
        )
        .await,
        1
    );
    // Each successful stage but the last sent the next stage's job, once.
    assert_eq!(
        count(
            c,
            "SELECT queue FROM jobs GROUP BY queue HAVING count(*) = 1"
        )
        .await,
        3
    );
    assert_eq!(
        count(
            c,
            &format!(
                "SELECT * FROM jobs WHERE singleton_key = 'extract:t1:{}'",
                job.item_id
            )
        )
        .await,
        1
    );

    // Everything again: every stage skips, nothing new is written or sent.
    for stage in pipeline.stages() {
        let outcome = exec.run(&pipeline, stage, &job).await.unwrap();
        assert!(
            matches!(
                outcome,
                ExecutionOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
            ),
            "{outcome:?}"
        );
    }
    assert_eq!(count(c, "SELECT * FROM jobs").await, 3);
    assert_eq!(count(c, "SELECT * FROM audit_log").await, 4);

    let check = idemstage_example::check_example_pipeline(c).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new());
    assert_eq!(
        (check.items, check.items_final, check.stages_succeeded),
        (1, 1, 4)
    );
}

#[tokio::test]
async fn the_after_the_fact_check_sees_lost_stages_and_foreign_writes() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let job = f.item("10 Stk Schrauben").await;
    let exec = f.executor();
    exec.run(&pipeline, pipeline.first_stage(), &job)
        .await
        .unwrap();
    let check = idemstage_example::check_example_pipeline(&mut f.conn)
        .await
        .unwrap();
    // extract never ran: a lost stage, the item not final (feasibility, whose
    // upstream has no success, is not expected yet).
    assert_eq!((check.lost_stages, check.items_final), (1, 0));
    // A row claiming to come from an attempt that did not succeed is caught.
    diesel::sql_query("UPDATE audit_log SET attempt = attempt + 1 WHERE action = 'item.intake'")
        .execute(&mut f.conn)
        .await
        .unwrap();
    let check = idemstage_example::check_example_pipeline(&mut f.conn)
        .await
        .unwrap();
    assert_eq!(check.foreign_writes, 1);
    // ... and so is the successful run that now lacks its own audit entry.
    assert_eq!(check.missing_audit, 1);
    assert_eq!(check.violations().len(), 4, "{:?}", check.violations());
}

#[tokio::test]
async fn an_infeasible_item_stops_before_calculate() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let job = f.item("3 Fass Öl\nMontage").await;
    let exec = f.executor();
    for name in ["intake", "extract"] {
        let stage = pipeline.stage(name).unwrap();
        exec.run(&pipeline, stage, &job).await.unwrap();
    }
    let outcome = exec
        .run(&pipeline, pipeline.stage("feasibility").unwrap(), &job)
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            ExecutionOutcome::Succeeded {
                flow: idemstage_stage::StageFlow::Stop,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(
        count(&mut f.conn, "SELECT * FROM jobs WHERE queue = 'calculate'").await,
        0
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT * FROM feasibility_results WHERE NOT feasible AND jsonb_array_length(reasons) = 2"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn a_crash_mid_way_rolls_back_partial_writes_and_counts_as_an_attempt() {
    let mut f = fixture().await;
    let crashing = example::pipeline(Chaos::crashing(1.0));
    let job = f.item("10 Stk Schrauben").await;
    let exec = f.executor();
    let intake = crashing.stage("intake").unwrap();
    // Crash rate 1: every attempt fails after part of its writes (panic or error).
    for attempt in 1..=2 {
        let outcome = exec.run(&crashing, intake, &job).await.unwrap();
        match outcome {
            ExecutionOutcome::Failed {
                attempt: a,
                ref error,
                dead: false,
            } => {
                assert_eq!(a, attempt);
                assert!(error.contains("injected crash in intake"), "{error}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(count(&mut f.conn, "SELECT * FROM dateien").await, 0);
        assert_eq!(count(&mut f.conn, "SELECT * FROM audit_log").await, 0);
        assert_eq!(count(&mut f.conn, "SELECT * FROM jobs").await, 0);
    }
    // The same worker (same process) goes on: a healthy attempt succeeds.
    let healthy = example::pipeline(Chaos::default());
    let outcome = exec
        .run(&healthy, healthy.stage("intake").unwrap(), &job)
        .await
        .unwrap();
    assert!(
        matches!(outcome, ExecutionOutcome::Succeeded { attempt: 3, .. }),
        "{outcome:?}"
    );
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT * FROM stage_run_attempts WHERE outcome = 'failed'"
        )
        .await,
        2
    );
}

/// A stage whose body waits for the test, to hold a claim open.
struct Gate {
    policy: StagePolicy,
    release: Arc<Notify>,
    started: Arc<Notify>,
}

#[async_trait]
impl Stage for Gate {
    const NAME: &'static str = "gate";
    type Input = ();
    type Prepared = ();
    type Output = ();
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        self.started.notify_one();
        self.release.notified().await;
        Ok(())
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        tx.audit("gate", "gate.done", serde_json::json!({})).await?;
        Ok(Done::next(()))
    }
}

fn gate(lease_ms: u64, timeout_ms: u64) -> (Arc<Gate>, Pipeline) {
    let stage = Arc::new(Gate {
        policy: StagePolicy::default()
            .with_lease(Duration::from_millis(lease_ms))
            .with_heartbeat(Duration::from_millis(lease_ms / 4))
            .with_timeout(Duration::from_millis(timeout_ms)),
        release: Arc::new(Notify::new()),
        started: Arc::new(Notify::new()),
    });
    let pipeline = Pipeline::builder(stage.clone()).build().unwrap();
    (stage, pipeline)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_keeps_a_long_body_in_flight() {
    let mut f = fixture().await;
    let (stage, pipeline) = gate(400, 60_000);
    let job = f.item("1 h Warten").await;
    let running = {
        let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job.clone());
        tokio::spawn(async move {
            let stage = pipeline.stages()[0].clone();
            exec.run(&pipeline, &stage, &job).await.unwrap()
        })
    };
    stage.started.notified().await;
    // Let three lease lengths pass on the database clock while the body waits.
    let c = &mut f.conn;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(
        c,
        "SELECT 1 FROM stage_runs WHERE now() > started_at + interval '1200 milliseconds'",
    )
    .await
        == 0
    {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let other = ClaimRequest {
        tenant: job.tenant_id.clone(),
        item: job.item_id,
        stage: StageName::parse("gate").unwrap(),
        input_hash: job.input_hash.clone(),
        worker: WorkerId::generate(),
        policy: stage.policy.clone(),
        upstream: None,
    };
    assert!(
        matches!(
            f.repo.claim(&other).await.unwrap(),
            ClaimOutcome::Skipped(SkipReason::InFlight { .. })
        ),
        "the lease must have been renewed"
    );
    stage.release.notify_one();
    assert!(matches!(
        running.await.unwrap(),
        ExecutionOutcome::Succeeded { attempt: 1, .. }
    ));
}

#[tokio::test]
async fn a_body_that_never_returns_times_out_as_a_failed_attempt() {
    let mut f = fixture().await;
    let (_stage, pipeline) = gate(1_000, 200);
    let job = f.item("1 h Warten").await;
    let outcome = f
        .executor()
        .run(&pipeline, &pipeline.stages()[0], &job)
        .await
        .unwrap();
    match outcome {
        ExecutionOutcome::Failed {
            attempt: 1,
            error,
            dead: false,
        } => {
            assert!(error.contains("deadline"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(count(&mut f.conn, "SELECT * FROM audit_log").await, 0);
}

#[tokio::test]
async fn a_malformed_payload_is_a_clear_error() {
    let bad = serde_json::json!({ "tenant_id": "t1", "item_id": "nope", "input_hash": "x" });
    let err = StageJob::from_payload("extract", &bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("queue extract"), "{err}");
    assert!(err.contains("ULID"), "{err}");
    let unknown = serde_json::json!({ "tenant_id": "t1" , "extra": 1});
    assert!(StageJob::from_payload("extract", &unknown).is_err());
    let pipeline = example::pipeline(Chaos::default());
    assert_eq!(
        pipeline.stage("ocr").err().unwrap().to_string(),
        "unknown stage \"ocr\""
    );
}

/// An execution dropped mid-body (its job's handler task aborted because the job
/// lease was taken over, e.g. after a SIGSTOP) must stop renewing its claim: an
/// orphaned heartbeat kept the stage `running` for ever while nobody ran it (found
/// by the soak test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_dropped_mid_body_stops_renewing_its_lease() {
    let mut f = fixture().await;
    let (stage, pipeline) = gate(300, 60_000);
    let job = f.item("1 h Warten").await;
    let running = {
        let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job.clone());
        tokio::spawn(async move {
            let stage = pipeline.stages()[0].clone();
            exec.run(&pipeline, &stage, &job).await.unwrap()
        })
    };
    stage.started.notified().await;
    running.abort();
    assert!(running.await.unwrap_err().is_cancelled());
    // The lease must run out on the database clock (no one renews it any more).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(
        &mut f.conn,
        "SELECT 1 FROM stage_runs WHERE status = 'running' AND lease_expires_at < now()",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dropped execution's lease is still being renewed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And another worker can take the stage over.
    let req = ClaimRequest {
        tenant: job.tenant_id.clone(),
        item: job.item_id,
        stage: StageName::parse("gate").unwrap(),
        input_hash: job.input_hash.clone(),
        worker: WorkerId::generate(),
        policy: pipeline.stages()[0].policy().clone(),
        upstream: None,
    };
    assert!(matches!(
        f.repo.claim(&req).await.unwrap(),
        ClaimOutcome::Claimed { attempt: 2, .. }
    ));
}

/// `run_and_complete_job` completes the stage's queue job in the stage's own transaction (both
/// rows then carry that transaction's `now()`); a job taken over by another fetch
/// is left to its new holder, and the stage still succeeds.
#[tokio::test]
async fn a_leased_run_completes_its_job_in_the_stage_transaction() {
    let mut f = fixture().await;
    let pipeline = example::pipeline(Chaos::default());
    let job = f.item("10 Stk Schrauben M8").await;
    let exec = f.executor();
    let [intake, extract, ..] = pipeline.stages() else {
        panic!("the example pipeline has four stages")
    };
    let sent = first_job(
        &pipeline,
        job.tenant_id.clone(),
        job.item_id,
        job.input_hash.clone(),
    );
    queue::send_in(&mut f.conn, &sent).await.unwrap();
    let fetched = queue::fetch(&mut f.conn, &[intake.name().to_string()], 1)
        .await
        .unwrap()
        .remove(0);
    let lease = JobLease {
        id: fetched.id,
        attempt: fetched.attempt,
    };
    let outcome = exec
        .run_and_complete_job(&pipeline, intake, &job, lease)
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            ExecutionOutcome::Succeeded {
                job_completed: true,
                ..
            }
        ),
        "{outcome:?}"
    );
    let same_transaction = format!(
        "SELECT 1 FROM job_states j JOIN stage_runs r
             ON r.item_id = '{}' AND r.stage = 'intake' AND r.status = 'success'
          WHERE j.id = '{}' AND j.state = 'completed' AND j.completed_at = r.finished_at",
        job.item_id, fetched.id
    );
    assert_eq!(count(&mut f.conn, &same_transaction).await, 1);

    // The next stage's job, fetched, then fetched again elsewhere (its token moves on).
    let fetched = queue::fetch(&mut f.conn, &[extract.name().to_string()], 1)
        .await
        .unwrap()
        .remove(0);
    // Taken back (the attempt's end written, as maintenance's expiry writes it)
    // and fetched again: the job's current claim is the next attempt's.
    diesel::sql_query(format!(
        "UPDATE jobs SET attempt = attempt + 1, state = 'retry' WHERE id = '{}'",
        fetched.id
    ))
    .execute(&mut f.conn)
    .await
    .unwrap();
    let again = queue::fetch(&mut f.conn, &[extract.name().to_string()], 1)
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].attempt, fetched.attempt + 1);
    let stale = JobLease {
        id: fetched.id,
        attempt: fetched.attempt,
    };
    let outcome = exec
        .run_and_complete_job(&pipeline, extract, &job, stale)
        .await
        .unwrap();
    assert!(
        matches!(
            outcome,
            ExecutionOutcome::Succeeded {
                job_completed: false,
                ..
            }
        ),
        "{outcome:?}"
    );
    assert_eq!(
        count(
            &mut f.conn,
            &format!(
                "SELECT 1 FROM job_states WHERE id = '{}' AND state = 'active' AND attempt = {}",
                fetched.id,
                fetched.attempt + 1
            )
        )
        .await,
        1
    );
}

/// Item 1: a stage job that gives up before its stage (retry_limit 2 against
/// max_attempts 5) would leave the stage with no live job. Refused at construction.
#[test]
fn a_job_retry_budget_below_a_stages_attempts_is_refused() {
    let pipeline = example::pipeline(Chaos::default());
    let options = Pipeline::default_send_options().with_retry_limit(2);
    let Err(err) = pipeline.clone().with_send_options(options) else {
        panic!("a retry_limit below max_attempts was accepted");
    };
    assert!(
        matches!(
            err,
            idemstage_stage::PipelineError::RetryBudgetTooSmall {
                retry_limit: 2,
                max_attempts: 5,
                ..
            }
        ),
        "{err}"
    );
    assert!(err
        .to_string()
        .contains("below stage intake's max_attempts 5"));
    let enough = Pipeline::default_send_options().with_retry_limit(5);
    assert!(pipeline.with_send_options(enough).is_ok());
}
