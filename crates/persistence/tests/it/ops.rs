//! The operator commands (`persistence::ops`) against a real PostgreSQL, with
//! separate connections and real commits: retry of a dead stage (refused for a
//! success or a live lease, once under concurrent retries), cancel (a claimed
//! attempt is fenced at its commit), the dead-letter list, inspect, and the audit
//! entries with their actor.

use std::sync::Arc;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use futures_util::FutureExt;
use idemstage_domain::{
    ClaimOutcome, CompleteOutcome, RenewOutcome, RunStatus, SendResult, SkipReason,
};
use idemstage_example::{check_example_pipeline, Chaos};
use idemstage_persistence::ops::{
    self, Actor, CancelOutcome, CancelledFrom, DeadFilter, OpsError, RetryOutcome, RetryRefusal,
};
use idemstage_persistence::TxError;
use tokio::sync::Barrier;

use crate::support::*;

fn alice() -> Actor {
    Actor::parse("alice").unwrap()
}

fn pipeline() -> idemstage::pipeline::Pipeline {
    idemstage_example::pipeline(Chaos::default())
}

/// Everything the commands may change, as one text: what "nothing changed" compares.
async fn snapshot(conn: &mut AsyncPgConnection) -> String {
    #[derive(diesel::QueryableByName)]
    struct S {
        #[diesel(sql_type = diesel::sql_types::Text)]
        s: String,
    }
    use diesel_async::RunQueryDsl;
    diesel::sql_query(
        "SELECT coalesce((SELECT string_agg(r::text, '|' ORDER BY id) FROM stage_runs r), '')
             || coalesce((SELECT string_agg(a::text, '|' ORDER BY run_id, attempt)
                            FROM stage_run_attempts a), '')
             || coalesce((SELECT string_agg(j::text, '|' ORDER BY id) FROM job_states j), '')
             || coalesce((SELECT string_agg(l::text, '|' ORDER BY id) FROM audit_log l), '')
             AS s",
    )
    .get_result::<S>(conn)
    .await
    .unwrap()
    .s
}

/// Intake of a new item of `t1`, claimed with a budget of 1 and failed for good.
async fn dead_intake(
    conn: &mut AsyncPgConnection,
    repo: &idemstage_persistence::PgRunRepository,
) -> idemstage_domain::ClaimRequest {
    let item = new_item(conn, &tenant("t1")).await;
    let mut req = request(&tenant("t1"), item, "intake");
    req.policy.max_attempts = 1;
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.fail(&token, "the scanner is on fire", false)
        .await
        .unwrap();
    req
}

#[tokio::test]
async fn two_concurrent_retries_of_a_dead_stage_revive_it_once() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let req = dead_intake(&mut conn, &repo).await;

    let barrier = Arc::new(Barrier::new(2));
    let retry = |who: &'static str| {
        let (barrier, url, item) = (barrier.clone(), db.url().to_owned(), req.item);
        tokio::spawn(async move {
            let mut conn = idemstage_persistence::connect(&url).await.unwrap();
            let pipeline = pipeline();
            barrier.wait().await;
            ops::retry(
                &mut conn,
                &tenant("t1"),
                &item,
                Some(&stage("intake")),
                &Actor::parse(who).unwrap(),
                &pipeline,
            )
            .await
            .unwrap()
        })
    };
    let (a, b) = (retry("alice"), retry("bob"));
    let outcomes = [a.await.unwrap(), b.await.unwrap()];
    let retried: Vec<_> = outcomes
        .iter()
        .filter_map(|o| match o {
            RetryOutcome::Retried { stages } => Some(stages),
            _ => None,
        })
        .collect();
    assert_eq!(retried.len(), 1, "{outcomes:?}");
    assert_eq!(retried[0].len(), 1);
    let revived = &retried[0][0];
    assert!(matches!(revived.job, SendResult::Sent(_)), "{revived:?}");
    assert_eq!((revived.attempts, revived.max_attempts), (1, 1 + 5));
    assert_eq!(
        revived.last_error.as_deref(),
        Some("the scanner is on fire")
    );
    assert!(
        outcomes.iter().any(|o| *o
            == RetryOutcome::NothingToRetry {
                stage: Some(stage("intake")),
                status: Some(RunStatus::Failed),
            }),
        "{outcomes:?}"
    );
    // One new job, one audit entry naming its actor, no run_id (not a stage's write).
    let key = format!("intake:t1:{}", req.item);
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT 1 FROM job_states WHERE singleton_key = '{key}' AND state = 'created'"
            )
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &mut conn,
            &format!(
                "SELECT 1 FROM audit_log WHERE action = 'operator.retry' AND tenant_id = 't1' \
                   AND entity_id = '{}' AND run_id IS NULL \
                   AND details->>'actor' IN ('alice', 'bob') \
                   AND details->'stages'->0->>'stage' = 'intake'",
                req.item
            )
        )
        .await,
        1
    );
    // The normal claim takes it: attempt 2, on the item's stored input.
    let again = repo.claim(&req).await.unwrap();
    assert!(
        matches!(again, ClaimOutcome::Claimed { attempt: 2, .. }),
        "{again:?}"
    );
}

#[tokio::test]
async fn retry_of_a_succeeded_or_running_stage_or_bad_input_is_refused_and_changes_nothing() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let pipeline = pipeline();
    let t1 = tenant("t1");
    // intake succeeded, extract running with a live lease.
    let item = new_item(&mut conn, &t1).await;
    let req = request(&t1, item, "intake");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    assert_eq!(
        repo.complete(&token, &noop).await.unwrap(),
        CompleteOutcome::Committed
    );
    let mut extract = request(&t1, item, "extract");
    extract.upstream = Some(stage("intake"));
    let held = repo.claim(&extract).await.unwrap();
    assert!(matches!(held, ClaimOutcome::Claimed { .. }), "{held:?}");

    let before = snapshot(&mut conn).await;
    let retry = async |conn: &mut AsyncPgConnection, t: &str, a, s: Option<&str>| {
        ops::retry(
            conn,
            &tenant(t),
            &a,
            s.map(stage).as_ref(),
            &alice(),
            &pipeline,
        )
        .await
    };
    let refused = retry(&mut conn, "t1", item, Some("intake")).await;
    assert!(
        matches!(
            refused,
            Err(OpsError::RetryRefused {
                reason: RetryRefusal::Succeeded,
                ..
            })
        ),
        "{refused:?}"
    );
    let running = retry(&mut conn, "t1", item, Some("extract")).await;
    assert!(
        matches!(
            running,
            Err(OpsError::RetryRefused {
                reason: RetryRefusal::Running { .. },
                ..
            })
        ),
        "{running:?}"
    );
    let not_started = retry(&mut conn, "t1", item, Some("calculate")).await;
    assert!(
        matches!(not_started, Err(OpsError::StageNotStarted { .. })),
        "{not_started:?}"
    );
    let unknown = retry(&mut conn, "t1", item, Some("ocr")).await;
    assert!(
        matches!(unknown, Err(OpsError::UnknownStage(_))),
        "{unknown:?}"
    );
    // Another tenant's item, an unknown one: not found (RLS sees neither).
    let foreign = retry(&mut conn, "t2", item, None).await;
    assert!(
        matches!(foreign, Err(OpsError::ItemNotFound { .. })),
        "{foreign:?}"
    );
    let missing = retry(&mut conn, "t1", idemstage_domain::ItemId::new(), None).await;
    assert!(
        matches!(missing, Err(OpsError::ItemNotFound { .. })),
        "{missing:?}"
    );
    // Every stage asked for: none is dead.
    let nothing = retry(&mut conn, "t1", item, None).await.unwrap();
    assert_eq!(
        nothing,
        RetryOutcome::NothingToRetry {
            stage: None,
            status: None
        }
    );
    for e in [refused, running, not_started, unknown, foreign, missing] {
        let e = e.unwrap_err();
        assert!(e.is_bad_request() && !e.is_retryable(), "{e}");
    }
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "a refused retry changed something"
    );
}

#[tokio::test]
async fn cancel_fences_a_claimed_attempt_whose_commit_is_then_refused() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t1 = tenant("t1");
    let item = new_item(&mut conn, &t1).await;
    let pipeline = pipeline();
    // The intake job, fetched by a "worker" (its job lease) that claims the stage.
    let job = idemstage::pipeline::first_job(&pipeline, t1.clone(), item, hash_a());
    idemstage_persistence::queue::send_in(&mut conn, &job)
        .await
        .unwrap();
    let mut worker_conn = db.conn().await;
    let fetched = idemstage_persistence::queue::fetch(&mut worker_conn, &["intake".into()], 1)
        .await
        .unwrap();
    assert_eq!(fetched.len(), 1);
    let req = request(&t1, item, "intake");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());

    // The operator cancels on a connection of its own, and commits.
    let mut op_conn = db.conn().await;
    let outcome = ops::cancel(&mut op_conn, &t1, &item, &alice())
        .await
        .unwrap();
    let CancelOutcome::Cancelled { stages, jobs, .. } = &outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(stages.len(), 1, "{outcome:?}");
    assert_eq!(stages[0].stage, stage("intake"));
    assert_eq!(
        stages[0].from,
        CancelledFrom::Running {
            attempt: 1,
            lease_live: true
        }
    );
    assert_eq!(jobs.len(), 1);
    assert_eq!(
        (jobs[0].id, jobs[0].state.as_str()),
        (fetched[0].id, "active")
    );

    // The worker's commit (with a write of its own) is refused by the fence and
    // writes nothing; so are its renewal and its job's completion.
    let write = write_fn(|tx| {
        async move {
            tx.audit("x", "item.intake", serde_json::json!({})).await?;
            Ok(())
        }
        .boxed()
    });
    assert_eq!(
        repo.complete(&token, &write).await.unwrap(),
        CompleteOutcome::Fenced
    );
    assert_eq!(
        repo.renew_lease(&token, std::time::Duration::from_secs(30))
            .await
            .unwrap(),
        RenewOutcome::Fenced
    );
    let completed = worker_conn
        .transaction::<_, TxError, _>(async |c| {
            Ok(
                idemstage_persistence::queue::complete(c, fetched[0].id, fetched[0].attempt, None)
                    .await?,
            )
        })
        .await
        .unwrap();
    assert_eq!(completed, idemstage_domain::JobCompleteOutcome::Fenced);
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM audit_log WHERE action = 'item.intake'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_run_attempts WHERE attempt = 1 AND outcome = 'cancelled' \
               AND error = 'cancelled by alice'"
        )
        .await,
        1
    );
    // Final: a later claim is skipped as cancelled, a second cancel finds nothing.
    assert!(matches!(
        repo.claim(&req).await.unwrap(),
        ClaimOutcome::Skipped(SkipReason::Cancelled { .. })
    ));
    assert_eq!(
        ops::cancel(&mut op_conn, &t1, &item, &alice())
            .await
            .unwrap(),
        CancelOutcome::NothingToCancel
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM audit_log WHERE action = 'operator.cancel' AND run_id IS NULL \
               AND details->>'actor' = 'alice'"
        )
        .await,
        1
    );
    // A cancelled stage is final: not lost, no broken history, nothing foreign.
    let check = check_example_pipeline(&mut conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert!(check.is_quiet(), "{check:?}");
    assert_eq!(check.runs_by_status.get("cancelled"), Some(&1));
}

#[tokio::test]
async fn cancel_of_a_queued_stage_creates_its_run_cancelled() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 2).await;
    let mut conn = db.conn().await;
    let t1 = tenant("t1");
    let pipeline = pipeline();
    // intake succeeded and sent extract's job, which nobody has fetched yet.
    let item = new_item(&mut conn, &t1).await;
    let req = request(&t1, item, "intake");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    let next = pipeline.job_for(
        &stage("extract"),
        &idemstage::stage::StageJob {
            tenant_id: t1.clone(),
            item_id: item,
            input_hash: hash_a(),
        },
    );
    let send = write_fn(move |tx| {
        let next = next.clone();
        async move {
            // intake's audit entry, as the example's intake writes it.
            let item = tx.token().item.to_string();
            tx.audit(&item, "item.intake", serde_json::json!({}))
                .await?;
            tx.send_job(&next).await?;
            Ok(())
        }
        .boxed()
    });
    assert_eq!(
        repo.complete(&token, &send).await.unwrap(),
        CompleteOutcome::Committed
    );
    let outcome = ops::cancel(&mut conn, &t1, &item, &alice()).await.unwrap();
    let CancelOutcome::Cancelled { stages, jobs, .. } = &outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(
        (stages.len(), stages[0].stage.as_str(), &stages[0].from),
        (1, "extract", &CancelledFrom::Queued),
        "{outcome:?}"
    );
    assert_eq!(jobs.len(), 1);
    let run = repo
        .read_run(&t1, &item, &stage("extract"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (run.status, run.worker_id.as_str()),
        (RunStatus::Cancelled, "operator:alice")
    );
    // A job for it sent later (by hand) cannot claim it.
    let mut extract = request(&t1, item, "extract");
    extract.upstream = Some(stage("intake"));
    assert!(matches!(
        repo.claim(&extract).await.unwrap(),
        ClaimOutcome::Skipped(SkipReason::Cancelled { .. })
    ));
    let check = check_example_pipeline(&mut conn).await.unwrap();
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert!(check.is_quiet(), "{check:?}");
}

#[tokio::test]
async fn the_dead_letter_list_shows_dead_stages_and_failed_jobs_with_their_last_errors() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 2).await;
    let mut conn = db.conn().await;
    let first = dead_intake(&mut conn, &repo).await;
    let second = dead_intake(&mut conn, &repo).await;
    // One of another tenant, dead of another error.
    let a3 = new_item(&mut conn, &tenant("t2")).await;
    let mut req = request(&tenant("t2"), a3, "intake");
    req.policy.max_attempts = 1;
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.fail(&token, "out of toner", true).await.unwrap();

    let all = ops::dead(&mut conn, &DeadFilter::default()).await.unwrap();
    assert_eq!(all.stages.len(), 3, "{all:?}");
    assert!(all
        .stages
        .iter()
        .any(|d| d.item == a3 && d.last_error.as_deref() == Some("out of toner")));
    let t1 = ops::dead(
        &mut conn,
        &DeadFilter {
            tenant: Some(tenant("t1")),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut items: Vec<_> = t1.stages.iter().map(|d| d.item).collect();
    items.sort();
    let mut want = vec![first.item, second.item];
    want.sort();
    assert_eq!(items, want);
    assert!(t1
        .stages
        .iter()
        .all(|d| d.last_error.as_deref() == Some("the scanner is on fire")));
    let none = ops::dead(
        &mut conn,
        &DeadFilter {
            stage: Some(stage("extract")),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(none.stages.is_empty(), "{none:?}");
}

#[tokio::test]
async fn inspect_shows_every_attempt_with_its_upstream_and_every_job() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 2).await;
    let mut conn = db.conn().await;
    let t1 = tenant("t1");
    let item = new_item(&mut conn, &t1).await;
    let pipeline = pipeline();
    let job = idemstage::pipeline::first_job(&pipeline, t1.clone(), item, hash_a());
    idemstage_persistence::queue::send_in(&mut conn, &job)
        .await
        .unwrap();
    // intake: attempt 1 failed, attempt 2 succeeded; extract running on it.
    let req = request(&t1, item, "intake");
    let first = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.fail(&first, "flaky", true).await.unwrap();
    let second = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.complete(&second, &noop).await.unwrap();
    let mut extract = request(&t1, item, "extract");
    extract.upstream = Some(stage("intake"));
    repo.claim(&extract).await.unwrap();

    let t = ops::inspect(&mut conn, &t1, &item).await.unwrap();
    assert_eq!((t.tenant.as_str(), t.item), ("t1", item));
    assert_eq!(t.input_sha256, hash_a());
    let names: Vec<_> = t.stages.iter().map(|s| s.stage.as_str()).collect();
    assert_eq!(names, ["intake", "extract"]);
    let intake = &t.stages[0];
    assert_eq!(
        (
            intake.status,
            intake.success_attempt,
            intake.attempts_history.len()
        ),
        (RunStatus::Success, Some(2), 2)
    );
    assert_eq!(intake.attempts_history[0].outcome, "failed");
    assert_eq!(intake.attempts_history[0].error.as_deref(), Some("flaky"));
    assert_eq!(intake.attempts_history[1].outcome, "success");
    let ex = &t.stages[1];
    assert!(ex.lease_live);
    assert_eq!(
        (
            ex.upstream_stage.as_ref().map(|s| s.as_str()),
            ex.upstream_attempt
        ),
        (Some("intake"), Some(2))
    );
    assert_eq!(ex.attempts_history[0].upstream_attempt, Some(2));
    assert!(ex.attempts_history[0].lease_expires_at.is_some());
    assert_eq!(t.jobs.len(), 1);
    assert_eq!(
        (t.jobs[0].queue.as_str(), t.jobs[0].state.as_str()),
        ("intake", "created")
    );
    // Another tenant sees no such item.
    assert!(matches!(
        ops::inspect(&mut conn, &tenant("t2"), &item).await,
        Err(OpsError::ItemNotFound { .. })
    ));
}

#[test]
fn an_actor_is_a_short_printable_name() {
    assert_eq!(Actor::parse("  alice ").unwrap().as_str(), "alice");
    for bad in ["", "   ", "a\nb", &"x".repeat(129)] {
        assert!(Actor::parse(bad).is_err(), "{bad:?}");
    }
}
