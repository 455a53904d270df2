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

/// Success attempts of `stage` for `item`.
async fn successes(conn: &mut diesel_async::AsyncPgConnection, item: &ItemId, stage: &str) -> i64 {
    idemstage_testkit::count(
        conn,
        &format!(
            "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id \
              WHERE r.item_id = '{item}' AND r.stage = '{stage}' AND a.outcome = 'success'"
        ),
    )
    .await
}

#[tokio::test]
async fn an_operator_rerun_runs_the_stage_and_every_stage_after_it_once_more() {
    let db = idemstage_harness::example::db().await;
    let pool = db.pool(8).await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let (rerun_item, other) = (ItemId::new(), ItemId::new());
    send(&mut conn, &tenant, rerun_item, &text(1)).await;
    send(&mut conn, &tenant, other, &text(2)).await;
    let counters = Arc::new(idemstage::worker::Counters::default());
    let pipeline = idemstage_harness::example::pipeline();
    let worker = start_pipeline_worker(
        pool.clone(),
        db.url(),
        pipeline.clone(),
        2,
        counters.clone(),
    );
    assert_quiet_and_sound(db.url(), 60).await;
    stop_pipeline_worker(worker).await;

    let extract = idemstage_domain::StageName::parse("extract").unwrap();
    let actor = Actor::parse("prompt-fixer").unwrap();
    let outcome = ops::rerun(&mut conn, &tenant, &rerun_item, &extract, &actor, &pipeline)
        .await
        .unwrap();
    let ops::RerunOutcome::Rerun {
        from, invalidated, ..
    } = &outcome
    else {
        panic!("{outcome:?}")
    };
    assert_eq!(*from, idemstage_domain::RunStatus::Success);
    assert_eq!(*invalidated, 2, "feasibility and calculate");
    // A second rerun before the workers ran it: the stage is stale, nothing to do.
    let again = ops::rerun(&mut conn, &tenant, &rerun_item, &extract, &actor, &pipeline)
        .await
        .unwrap();
    assert!(
        matches!(again, ops::RerunOutcome::NothingToRerun { .. }),
        "{again:?}"
    );

    let worker = start_pipeline_worker(pool, db.url(), pipeline, 2, counters);
    // The checker counts a second success on the same input and upstream as a
    // double execution unless an operator's rerun (stage_reruns) lies between.
    let check = assert_quiet_and_sound(db.url(), 60).await;
    stop_pipeline_worker(worker).await;
    assert_eq!(check.stages_succeeded, 8, "{check:?}");
    for (stage, runs) in [
        ("intake", 1),
        ("extract", 2),
        ("feasibility", 2),
        ("calculate", 2),
    ] {
        assert_eq!(
            successes(&mut conn, &rerun_item, stage).await,
            runs,
            "{stage}"
        );
        assert_eq!(successes(&mut conn, &other, stage).await, 1, "{stage}");
    }
    let audited = idemstage_testkit::count(
        &mut conn,
        &format!(
            "SELECT 1 FROM audit_log WHERE action = 'operator.rerun' AND entity_id = '{rerun_item}' \
               AND details->>'actor' = 'prompt-fixer' AND details->>'stage' = 'extract'"
        ),
    )
    .await;
    assert_eq!(audited, 1);
}

#[tokio::test]
async fn a_rerun_of_a_cancelled_item_or_a_stage_never_run_is_refused_and_changes_nothing() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    send(&mut conn, &tenant, item, &text(1)).await;
    let pipeline = idemstage_harness::example::pipeline();
    let actor = Actor::parse("ops").unwrap();
    let intake = idemstage_domain::StageName::parse("intake").unwrap();
    let before = rows(&mut conn).await;
    let err = ops::rerun(&mut conn, &tenant, &item, &intake, &actor, &pipeline)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ops::OpsError::StageNotStarted { .. }),
        "{err}"
    );
    assert!(err.is_bad_request());
    let nobody = ops::rerun(
        &mut conn,
        &tenant,
        &ItemId::new(),
        &intake,
        &actor,
        &pipeline,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(nobody, ops::OpsError::ItemNotFound { .. }),
        "{nobody}"
    );
    assert_eq!(rows(&mut conn).await, before);

    ops::cancel(&mut conn, &tenant, &item, &actor)
        .await
        .unwrap();
    let before = rows(&mut conn).await;
    let err = ops::rerun(&mut conn, &tenant, &item, &intake, &actor, &pipeline)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ops::OpsError::RerunRefused {
                reason: ops::RerunRefusal::Cancelled,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(rows(&mut conn).await, before);
}

#[tokio::test]
async fn a_bulk_rerun_acts_on_the_items_its_filter_selects_once_and_a_second_run_finds_it_done() {
    let db = idemstage_harness::example::db().await;
    let pool = db.pool(8).await;
    let mut conn = db.conn().await;
    let (t1, t2) = (
        TenantId::parse("t1").unwrap(),
        TenantId::parse("t2").unwrap(),
    );
    let mut items = Vec::new();
    for i in 0..12 {
        let (tenant, item) = (if i % 3 == 0 { &t2 } else { &t1 }, ItemId::new());
        send(&mut conn, tenant, item, &text(i)).await;
        items.push((tenant.clone(), item));
    }
    let counters = Arc::new(idemstage::worker::Counters::default());
    let pipeline = idemstage_harness::example::pipeline();
    let worker = start_pipeline_worker(
        pool.clone(),
        db.url(),
        pipeline.clone(),
        2,
        counters.clone(),
    );
    assert_quiet_and_sound(db.url(), 60).await;
    stop_pipeline_worker(worker).await;

    let filter = ops::BulkFilter {
        tenant: Some(t1.clone()),
        stage: Some(idemstage_domain::StageName::parse("calculate").unwrap()),
        statuses: vec![idemstage_domain::RunStatus::Success],
        ..Default::default()
    };
    let preview = ops::preview(&mut conn, ops::BulkAction::Rerun, &filter)
        .await
        .unwrap();
    assert_eq!((preview.selected, preview.eligible), (8, 8), "{preview:?}");
    let actor = Actor::parse("bulk-ops").unwrap();
    let started = ops::start_bulk(&mut conn, ops::BulkAction::Rerun, &filter, &actor, 3)
        .await
        .unwrap();
    let mut seen = Vec::new();
    let done = ops::run_bulk(&mut conn, &started.id, &actor, &pipeline, |p| {
        seen.push(p.acted)
    })
    .await
    .unwrap();
    assert_eq!(
        (done.selected, done.acted, done.batches),
        (8, 8, 3),
        "{done:?}"
    );
    assert!(done.finished_at.is_some());
    assert_eq!(seen.first(), Some(&3));
    // Run again (a resume after the end): nothing more.
    let again = ops::run_bulk(&mut conn, &started.id, &actor, &pipeline, |_| {})
        .await
        .unwrap();
    assert_eq!((again.acted, again.batches), (8, 3));
    let preview = ops::preview(&mut conn, ops::BulkAction::Rerun, &filter)
        .await
        .unwrap();
    assert_eq!(preview.selected, 0, "the reruns are stale now: {preview:?}");

    let worker = start_pipeline_worker(pool, db.url(), pipeline.clone(), 2, counters);
    assert_quiet_and_sound(db.url(), 60).await;
    stop_pipeline_worker(worker).await;
    for (tenant, item) in &items {
        let want = if tenant == &t1 { 2 } else { 1 };
        assert_eq!(
            successes(&mut conn, item, "calculate").await,
            want,
            "{tenant} {item}"
        );
        assert_eq!(successes(&mut conn, item, "feasibility").await, 1);
    }
    let audited = idemstage_testkit::count(
        &mut conn,
        &format!(
            "SELECT 1 FROM audit_log WHERE action = 'operator.rerun' \
               AND details->>'bulk' = '{}'",
            started.id
        ),
    )
    .await;
    assert_eq!(audited, 8);

    // A record changed by hand (its rerun's stage removed) is refused when run,
    // not acted on (and no worker panics on it).
    let tampered = ops::start_bulk(&mut conn, ops::BulkAction::Rerun, &filter, &actor, 3)
        .await
        .unwrap();
    diesel_async::RunQueryDsl::execute(
        diesel::sql_query(format!(
            "UPDATE bulk_actions SET filter = filter - 'stage' WHERE id = '{}'",
            tampered.id
        )),
        &mut conn,
    )
    .await
    .unwrap();
    let err = ops::run_bulk(&mut conn, &tampered.id, &actor, &pipeline, |_| {})
        .await
        .unwrap_err();
    assert!(matches!(err, ops::OpsError::Invalid(_)), "{err}");
    let progress = ops::bulk_progress(&mut conn, &tampered.id).await.unwrap();
    assert_eq!((progress.batches, progress.acted), (0, 0));
}

async fn rows(c: &mut diesel_async::AsyncPgConnection) -> i64 {
    idemstage_testkit::count(
        c,
        "SELECT 1 FROM stage_runs UNION ALL SELECT 1 FROM audit_log",
    )
    .await
}
