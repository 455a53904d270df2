//! Durable waits: a stage ends in `waiting` for a signal or a timer, holding no
//! lease and no job; the signal is delivered once (a second delivery changes
//! nothing), to its tenant only; the deadline fails the run or resumes it, as
//! the wait said.

use std::sync::atomic::{AtomicUsize, Ordering};

use idemstage_domain::{OnTimeout, RunStatus, Signal, WaitFor};
use idemstage_persistence::ops::{self, Actor, SignalOutcome, SignalRefusal};
use serde_json::json;

use super::*;

/// The first stage: hands the input on.
struct Draft;

#[async_trait]
impl Stage for Draft {
    const NAME: &'static str = "draft";
    type Input = String;
    type Prepared = ();
    type Output = String;
    async fn prepare(&self, _: &PrepareContext<'_, String>) -> Result<(), StageError> {
        Ok(())
    }
    async fn commit(
        &self,
        _: &mut FencedTx<'_>,
        input: &String,
        _: &(),
    ) -> Result<Done<String>, StageError> {
        Ok(Done::next(input.clone()))
    }
}

/// The second stage: a paid call in `prepare` (counted), then waits for the
/// signal `review`; run again, it hands on what the review said.
struct Approve {
    calls: AtomicUsize,
    timeout: Duration,
    on_timeout: OnTimeout,
}

#[async_trait]
impl Stage for Approve {
    const NAME: &'static str = "approve";
    type Input = String;
    type Prepared = String;
    type Output = String;
    async fn prepare(&self, ctx: &PrepareContext<'_, String>) -> Result<String, StageError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(ctx.input().to_uppercase())
    }
    async fn commit(
        &self,
        tx: &mut FencedTx<'_>,
        _: &String,
        summary: &String,
    ) -> Result<Done<String>, StageError> {
        match tx.signal().await? {
            None => Err(WaitFor::signal("review", self.timeout)?
                .on_timeout(self.on_timeout)
                .into()),
            Some(Signal::Delivered { payload, actor, .. }) => Ok(Done::next(format!(
                "{summary}: {} by {actor}",
                payload["verdict"].as_str().unwrap_or("?")
            ))),
            Some(Signal::TimedOut) => Ok(Done::next(format!("{summary}: no review"))),
        }
    }
}

fn approve(timeout: Duration, on_timeout: OnTimeout) -> Arc<Approve> {
    Arc::new(Approve {
        calls: AtomicUsize::new(0),
        timeout,
        on_timeout,
    })
}

fn pipeline(approve: &Arc<Approve>) -> Pipeline {
    Pipeline::builder(Draft)
        .then(approve.clone())
        .build()
        .unwrap()
}

async fn run(f: &Fixture, pipeline: &Pipeline, stage: &str, job: &StageJob) -> ExecutionOutcome {
    let stage = pipeline.stage(stage).unwrap();
    f.executor().run(pipeline, stage, job).await.unwrap()
}

async fn status(f: &mut Fixture, stage: &str) -> String {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Text)]
        status: String,
    }
    diesel::sql_query(format!(
        "SELECT status FROM stage_runs WHERE stage = '{stage}'"
    ))
    .get_result::<Row>(&mut f.conn)
    .await
    .unwrap()
    .status
}

async fn output(f: &mut Fixture) -> serde_json::Value {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Jsonb)]
        output: serde_json::Value,
    }
    diesel::sql_query("SELECT output FROM stage_runs WHERE stage = 'approve'")
        .get_result::<Row>(&mut f.conn)
        .await
        .unwrap()
        .output
}

fn review() -> StageName {
    StageName::parse("review").unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stage_holds_nothing_runs_again_once_signalled_and_a_second_signal_changes_nothing(
) {
    let mut f = fixture().await;
    let approver = approve(Duration::from_secs(3600), OnTimeout::Fail);
    let pipeline = pipeline(&approver);
    let job = f.item("angebot 17").await;
    assert!(matches!(
        run(&f, &pipeline, "draft", &job).await,
        ExecutionOutcome::Succeeded { .. }
    ));
    let waited = run(&f, &pipeline, "approve", &job).await;
    assert!(
        matches!(waited, ExecutionOutcome::Waiting { attempt: 1, .. }),
        "{waited:?}"
    );
    assert_eq!(status(&mut f, "approve").await, "waiting");
    // No lease held, no job left for it.
    let c = &mut f.conn;
    assert_eq!(
        count(c, "SELECT 1 FROM stage_runs WHERE stage = 'approve' AND lease_expires_at > clock_timestamp()").await,
        0
    );
    assert_eq!(
        count(
            c,
            "SELECT 1 FROM stage_run_attempts WHERE outcome = 'waiting'"
        )
        .await,
        1
    );
    // A job for it meanwhile (a duplicate send, the reconciler) runs nothing.
    let again = run(&f, &pipeline, "approve", &job).await;
    assert!(
        matches!(again, ExecutionOutcome::Skipped(SkipReason::Waiting { .. })),
        "{again:?}"
    );

    let actor = Actor::parse("reviewer-anna").unwrap();
    let stage = StageName::parse("approve").unwrap();
    let delivered = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &review(),
        &json!({ "verdict": "approved" }),
        &actor,
        &pipeline,
    )
    .await
    .unwrap();
    assert!(
        matches!(delivered, SignalOutcome::Delivered { attempt: 1, .. }),
        "{delivered:?}"
    );
    // Delivered twice: reported, not applied again.
    let twice = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &review(),
        &json!({ "verdict": "rejected" }),
        &Actor::parse("reviewer-bob").unwrap(),
        &pipeline,
    )
    .await
    .unwrap();
    assert!(
        matches!(&twice, SignalOutcome::AlreadyDelivered { actor, .. } if actor == "reviewer-anna"),
        "{twice:?}"
    );
    let c = &mut f.conn;
    assert_eq!(
        count(
            c,
            "SELECT 1 FROM job_states WHERE queue = 'approve' AND state = 'created'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            c,
            "SELECT 1 FROM audit_log WHERE action = 'operator.signal'"
        )
        .await,
        1
    );

    // Run again: the paid call is not paid again, the review is read.
    let done = run(&f, &pipeline, "approve", &job).await;
    assert!(
        matches!(done, ExecutionOutcome::Succeeded { attempt: 2, .. }),
        "{done:?}"
    );
    assert_eq!(AtomicUsize::load(&approver.calls, Ordering::SeqCst), 1);
    assert_eq!(
        output(&mut f).await,
        json!("ANGEBOT 17: approved by reviewer-anna")
    );
    let check = idemstage_testkit::check_pipeline(&mut f.conn, &pipeline)
        .await
        .unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    // A signal after the success: not waiting, nothing changed.
    let late = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &StageName::parse("other").unwrap(),
        &json!(null),
        &actor,
        &pipeline,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            late,
            ops::OpsError::SignalRefused {
                reason: SignalRefusal::NotWaiting {
                    status: RunStatus::Success
                },
                ..
            }
        ),
        "{late}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_for_another_tenant_or_another_name_is_refused_and_changes_nothing() {
    let mut f = fixture().await;
    let approver = approve(Duration::from_secs(3600), OnTimeout::Fail);
    let pipeline = pipeline(&approver);
    let job = f.item("angebot 18").await;
    run(&f, &pipeline, "draft", &job).await;
    run(&f, &pipeline, "approve", &job).await;
    let stage = StageName::parse("approve").unwrap();
    let actor = Actor::parse("mallory").unwrap();
    let snapshot = "SELECT 1 FROM stage_waits WHERE ended_at IS NULL \
                    UNION ALL SELECT 1 FROM audit_log UNION ALL SELECT 1 FROM jobs";
    let before = count(&mut f.conn, snapshot).await;
    // Another tenant cannot reach the item.
    let other = TenantId::parse("t2").unwrap();
    let err = ops::signal(
        &mut f.conn,
        &other,
        &job.item_id,
        &stage,
        &review(),
        &json!({ "verdict": "approved" }),
        &actor,
        &pipeline,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ops::OpsError::ItemNotFound { .. }), "{err}");
    // Another signal than the one it waits for.
    let err = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &StageName::parse("payment").unwrap(),
        &json!({}),
        &actor,
        &pipeline,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(
            &err,
            ops::OpsError::SignalRefused {
                reason: SignalRefusal::OtherSignal { waiting_for: Some(s) },
                ..
            } if s.as_str() == "review"
        ),
        "{err}"
    );
    assert!(err.is_bad_request());
    // A payload one byte over the limit (as JSON text).
    let over = json!("x".repeat(ops::MAX_SIGNAL_PAYLOAD_BYTES - 1));
    assert_eq!(over.to_string().len(), ops::MAX_SIGNAL_PAYLOAD_BYTES + 1);
    let err = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &review(),
        &over,
        &actor,
        &pipeline,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ops::OpsError::Invalid(_)), "{err}");
    assert_eq!(count(&mut f.conn, snapshot).await, before);
    assert_eq!(status(&mut f, "approve").await, "waiting");

    // One exactly at the limit is delivered.
    let at = json!("x".repeat(ops::MAX_SIGNAL_PAYLOAD_BYTES - 2));
    assert_eq!(at.to_string().len(), ops::MAX_SIGNAL_PAYLOAD_BYTES);
    let delivered = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &review(),
        &at,
        &actor,
        &pipeline,
    )
    .await
    .unwrap();
    assert!(
        matches!(delivered, SignalOutcome::Delivered { .. }),
        "{delivered:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_stage_cancelled_or_invalidated_ends_its_wait_at_once() {
    let mut f = fixture().await;
    let approver = approve(Duration::from_secs(3600), OnTimeout::Fail);
    let pipeline = pipeline(&approver);
    let stage = StageName::parse("approve").unwrap();
    let actor = Actor::parse("ops").unwrap();
    let open = "SELECT 1 FROM stage_waits WHERE ended_at IS NULL";
    let gone = "SELECT 1 FROM stage_waits WHERE ended_by = 'gone'";

    // Cancelled: the wait ends with the run; a signal finds nothing waiting.
    let job = f.item("angebot 22").await;
    run(&f, &pipeline, "draft", &job).await;
    run(&f, &pipeline, "approve", &job).await;
    assert_eq!(count(&mut f.conn, open).await, 1);
    ops::cancel(&mut f.conn, &job.tenant_id, &job.item_id, &actor)
        .await
        .unwrap();
    assert_eq!(count(&mut f.conn, open).await, 0);
    assert_eq!(count(&mut f.conn, gone).await, 1);
    let err = ops::signal(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &stage,
        &review(),
        &json!({}),
        &actor,
        &pipeline,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, ops::OpsError::SignalRefused { .. }), "{err}");

    // Invalidated by an operator's rerun of its upstream: the wait ends; the
    // stage runs on the new upstream success and waits anew.
    let job = f.item("angebot 23").await;
    run(&f, &pipeline, "draft", &job).await;
    run(&f, &pipeline, "approve", &job).await;
    let draft = StageName::parse("draft").unwrap();
    ops::rerun(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        &draft,
        &actor,
        &pipeline,
    )
    .await
    .unwrap();
    assert_eq!(count(&mut f.conn, open).await, 0);
    assert_eq!(count(&mut f.conn, gone).await, 2);
    run(&f, &pipeline, "draft", &job).await;
    let again = run(&f, &pipeline, "approve", &job).await;
    assert!(
        matches!(again, ExecutionOutcome::Waiting { attempt: 2, .. }),
        "{again:?}"
    );
    assert_eq!(count(&mut f.conn, open).await, 1);
}

/// Waits until the open wait's deadline has passed on the database clock.
async fn deadline_passed(f: &mut Fixture) {
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(
        &mut f.conn,
        "SELECT 1 FROM stage_waits WHERE ended_at IS NULL AND wait_until <= clock_timestamp()",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < until,
            "no wait past its deadline"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_its_deadline_fails_the_run_or_resumes_it_as_configured() {
    let mut f = fixture().await;
    let stages = [
        StageName::parse("draft").unwrap(),
        StageName::parse("approve").unwrap(),
    ];
    // Fail: the run ends dead, a late signal is refused.
    let failing = approve(Duration::from_millis(200), OnTimeout::Fail);
    let pipeline = pipeline(&failing);
    let job = f.item("angebot 19").await;
    run(&f, &pipeline, "draft", &job).await;
    run(&f, &pipeline, "approve", &job).await;
    // Before its deadline, nothing ends it.
    let early = idemstage_persistence::waits::expire_due(&mut f.conn, &stages, &pipeline, 100)
        .await
        .unwrap();
    assert_eq!(early, Default::default());
    deadline_passed(&mut f).await;
    let expired = idemstage_persistence::waits::expire_due(&mut f.conn, &stages, &pipeline, 100)
        .await
        .unwrap();
    assert_eq!((expired.failed, expired.resumed), (1, 0));
    assert_eq!(status(&mut f, "approve").await, "dead");
    let again = idemstage_persistence::waits::expire_due(&mut f.conn, &stages, &pipeline, 100)
        .await
        .unwrap();
    assert_eq!(again, Default::default(), "ended once");
    // An operator's retry of the run that timed out: it waits again.
    ops::retry(
        &mut f.conn,
        &job.tenant_id,
        &job.item_id,
        None,
        &Actor::parse("ops").unwrap(),
        &pipeline,
    )
    .await
    .unwrap();
    let rewaited = run(&f, &pipeline, "approve", &job).await;
    assert!(
        matches!(rewaited, ExecutionOutcome::Waiting { attempt: 2, .. }),
        "{rewaited:?}"
    );

    // Resume: the stage runs again and reads that nobody answered.
    let mut f = fixture().await;
    let resuming = approve(Duration::from_millis(200), OnTimeout::Resume);
    let pipeline = super::waits::pipeline(&resuming);
    let job = f.item("angebot 20").await;
    run(&f, &pipeline, "draft", &job).await;
    run(&f, &pipeline, "approve", &job).await;
    deadline_passed(&mut f).await;
    let expired = idemstage_persistence::waits::expire_due(&mut f.conn, &stages, &pipeline, 100)
        .await
        .unwrap();
    assert_eq!((expired.failed, expired.resumed), (0, 1));
    assert_eq!(
        count(
            &mut f.conn,
            "SELECT 1 FROM job_states WHERE queue = 'approve' AND state = 'created'"
        )
        .await,
        1
    );
    let done = run(&f, &pipeline, "approve", &job).await;
    assert!(
        matches!(done, ExecutionOutcome::Succeeded { attempt: 2, .. }),
        "{done:?}"
    );
    assert_eq!(output(&mut f).await, json!("ANGEBOT 20: no review"));
    assert_eq!(AtomicUsize::load(&resuming.calls, Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_worker_ends_a_timed_out_wait_within_its_wait_interval_not_the_reconcilers() {
    let db = idemstage_harness::example::db().await;
    let pool = db.pool(16).await;
    let mut conn = db.conn().await;
    let resuming = approve(Duration::from_millis(300), OnTimeout::Resume);
    let pipeline = pipeline(&resuming);
    let tenant = TenantId::parse("t1").unwrap();
    idemstage::pipeline::start(&pool, &pipeline, &tenant, &ItemId::new(), "angebot 21")
        .await
        .unwrap();
    // The reconciler would come after 10 minutes: only the waits' loop can end it.
    let config = idemstage::worker::PipelineWorkerConfig::default()
        .with_reconcile_interval(Some(Duration::from_secs(600)))
        .with_wait_interval(Some(Duration::from_millis(200)));
    let worker = idemstage::worker::PipelineWorker::new(
        pool,
        db.url(),
        pipeline.clone(),
        config,
        Arc::new(idemstage::worker::Counters::default()),
    )
    .unwrap();
    let stop = idemstage::worker::CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'approve' AND status = 'success'",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the wait never ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    running.await.unwrap();
    let ended = count(
        &mut conn,
        "SELECT 1 FROM stage_waits WHERE ended_by = 'timeout' AND ended_at >= wait_until",
    )
    .await;
    assert_eq!(ended, 1);
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Jsonb)]
        output: serde_json::Value,
    }
    let out: Row = diesel::sql_query("SELECT output FROM stage_runs WHERE stage = 'approve'")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(out.output, json!("ANGEBOT 21: no review"));
}
