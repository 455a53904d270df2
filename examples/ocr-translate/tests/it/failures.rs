//! The team's own rows roll back with the attempt that wrote them: a body error
//! after the writes, a panic after the writes, a connection killed mid-transaction,
//! and a stale worker whose lease was taken over.

use std::time::Duration;

use idemstage::diesel_async::RunQueryDsl;
use idemstage::{items::RegisterOutcome, pipeline::Pipeline, stage::ExecutionOutcome};
use ocr_translate::{pipeline, pipeline_with, Fault, Faults, Ocr, Translate, OCR, TRANSLATE};

use crate::support::*;

pub const TEXT_1: &str = "erste seite\nzweite zeile\n\nzweite seite\x0cdritte seite";
pub const PAGES_1: [&str; 3] = ["erste seite\nzweite zeile", "zweite seite", "dritte seite"];
pub const TEXT_2: &str = "neue seite eins\n\n\nneue seite zwei\n";
pub const PAGES_2: [&str; 2] = ["neue seite eins", "neue seite zwei"];

fn failing_ocr() -> Pipeline {
    pipeline_with(Faults {
        ocr: Some(Fault::error()),
        ..Faults::default()
    })
}

fn failing_translate() -> Pipeline {
    pipeline_with(Faults {
        translate: Some(Fault::error()),
        ..Faults::default()
    })
}

/// A failing attempt's replacement of the pages (DELETE, then INSERT) and its
/// upsert of the translations (upsert, then delete of the rest) roll back: the
/// rows of the last success stay, whole.
#[tokio::test]
async fn a_failed_attempt_rolls_back_its_replacement_of_pages_and_translations() {
    let mut f = fixture().await;
    let healthy = pipeline();
    let exec = f.executor();
    let job = f.item(&healthy, &tenant("acme"), TEXT_1).await;
    for stage in healthy.stages() {
        let outcome = exec.run(&healthy, stage, &job).await.unwrap();
        assert!(
            matches!(outcome, ExecutionOutcome::Succeeded { attempt: 1, .. }),
            "{}: {outcome:?}",
            stage.name()
        );
    }
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_1, 1));
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 1, 1)
    );

    // New input (ocr reruns on it), and ocr fails after replacing the pages.
    let (changed, registered) = f
        .start(&healthy, &job.tenant_id, &job.item_id, TEXT_2)
        .await;
    assert!(matches!(registered, RegisterOutcome::Replaced { .. }));
    let failing = failing_ocr();
    match exec
        .run(&failing, failing.first_stage(), &changed)
        .await
        .unwrap()
    {
        ExecutionOutcome::Failed {
            attempt: 2,
            error,
            dead: false,
        } => assert!(
            error.contains("injected failure in ocr, attempt 2"),
            "{error}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_1, 1));
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 1, 1)
    );
    assert_eq!(
        f.count_for(&job, "SELECT 1 FROM audit_log WHERE action = 'ocr.pages'")
            .await,
        1,
        "the failed attempt's audit entry is gone too"
    );
    // A failed rerun invalidates nothing: translate keeps its success.
    assert_eq!(f.status(&job, TRANSLATE).await, "success");

    // ocr succeeds on the new input; translate is stale, and fails after its writes.
    assert!(matches!(
        exec.run(&healthy, healthy.first_stage(), &changed)
            .await
            .unwrap(),
        ExecutionOutcome::Succeeded { attempt: 3, .. }
    ));
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_2, 3));
    assert_eq!(f.status(&job, TRANSLATE).await, "stale");
    let failing = failing_translate();
    let translate = failing.stage(TRANSLATE).unwrap();
    match exec.run(&failing, translate, &changed).await.unwrap() {
        ExecutionOutcome::Failed {
            attempt: 2,
            error,
            dead: false,
        } => assert!(error.contains("injected failure in translate"), "{error}"),
        other => panic!("{other:?}"),
    }
    // The upsert of pages 1 and 2 and the delete of page 3 rolled back: the stale
    // translations of ocr attempt 1 are untouched.
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 1, 1)
    );

    let outcome = exec
        .run(&healthy, healthy.stage(TRANSLATE).unwrap(), &changed)
        .await
        .unwrap();
    assert!(
        matches!(outcome, ExecutionOutcome::Succeeded { attempt: 3, .. }),
        "{outcome:?}"
    );
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_2, 3, 3)
    );
    assert_eq!(
        f.count_for(
            &job,
            "SELECT 1 FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id
              WHERE r.item_id = '{item}' AND a.outcome = 'failed'"
        )
        .await,
        2
    );
}

/// A panic after the writes is a failed attempt, and none of its rows remain: no
/// page, no translation, no audit entry, no job for the next stage.
#[tokio::test]
async fn a_panic_after_the_writes_leaves_none_of_the_attempts_rows() {
    let mut f = fixture().await;
    let healthy = pipeline();
    let panicking = pipeline_with(Faults {
        ocr: Some(Fault::panic()),
        translate: Some(Fault::panic()),
    });
    let exec = f.executor();
    let job = f.item(&healthy, &tenant("acme"), TEXT_1).await;

    match exec
        .run(&panicking, panicking.first_stage(), &job)
        .await
        .unwrap()
    {
        ExecutionOutcome::Failed {
            attempt: 1,
            error,
            dead: false,
        } => assert!(
            error.contains("panicked") && error.contains("injected panic in ocr"),
            "{error}"
        ),
        other => panic!("{other:?}"),
    }
    assert_eq!(f.pages(&job).await, vec![]);
    assert_eq!(f.count_for(&job, "SELECT 1 FROM audit_log").await, 0);
    assert_eq!(
        f.count_for(&job, "SELECT 1 FROM jobs WHERE queue = 'translate'")
            .await,
        0
    );

    // The same worker goes on: ocr succeeds, then translate panics after its writes.
    assert!(matches!(
        exec.run(&healthy, healthy.first_stage(), &job)
            .await
            .unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    match exec
        .run(&panicking, panicking.stage(TRANSLATE).unwrap(), &job)
        .await
        .unwrap()
    {
        ExecutionOutcome::Failed {
            attempt: 1, error, ..
        } => assert!(error.contains("injected panic in translate"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(f.translations(&job).await, vec![]);
    assert_eq!(
        f.count_for(
            &job,
            "SELECT 1 FROM audit_log WHERE action = 'translate.pages'"
        )
        .await,
        0
    );
    assert!(matches!(
        exec.run(&healthy, healthy.stage(TRANSLATE).unwrap(), &job)
            .await
            .unwrap(),
        ExecutionOutcome::Succeeded { attempt: 2, .. }
    ));
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 2, 2)
    );
}

/// A worker that dies mid-transaction (its connection killed while the fenced
/// transaction is open, after the writes): the server rolls the transaction back;
/// none of its pages was ever visible, and none remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_mid_transaction_leaves_none_of_its_rows() {
    let mut f = fixture().await;
    let sleeper = SleepsAfterWritesOnce::new(Ocr::new(None));
    let pipeline = Pipeline::builder(sleeper.clone())
        .then(Translate::new(None))
        .build()
        .unwrap();
    let job = f.item(&pipeline, &tenant("acme"), TEXT_1).await;
    let running = {
        let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job.clone());
        tokio::spawn(async move {
            let ocr = pipeline.first_stage().clone();
            exec.run(&pipeline, &ocr, &job).await.unwrap()
        })
    };
    sleeper.sleeping.notified().await;
    let killed_ids = sleeper.ids_seen.lock().unwrap().clone();
    assert_eq!(killed_ids.len(), 3, "the transaction saw its own pages");
    // Uncommitted: nobody else sees them.
    assert_eq!(f.pages(&job).await, vec![]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(
        &mut f.conn,
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()
            AND query = 'SELECT pg_sleep(60)' AND xact_start IS NOT NULL",
    )
    .await
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no sleeping backend"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    diesel::sql_query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
          WHERE datname = current_database() AND query = 'SELECT pg_sleep(60)'",
    )
    .execute(&mut f.conn)
    .await
    .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the execution returns after its connection died")
        .unwrap();
    // The killed transaction's outcome is unknown to the executor until it reads
    // the run again: not committed, so it runs the transaction again, on a new
    // connection, and that one commits.
    assert!(
        matches!(outcome, ExecutionOutcome::Succeeded { attempt: 1, .. }),
        "{outcome:?}"
    );
    let ids = f.page_ids(&job).await;
    assert_eq!(ids.len(), 3);
    assert!(
        ids.iter().all(|id| !killed_ids.contains(id)),
        "a page of the killed transaction survived: {ids:?} vs {killed_ids:?}"
    );
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_1, 1));
    assert_eq!(
        f.count_for(&job, "SELECT 1 FROM audit_log WHERE action = 'ocr.pages'")
            .await,
        1
    );
    assert_eq!(
        f.count_for(&job, "SELECT 1 FROM jobs WHERE queue = 'translate'")
            .await,
        1
    );
}

/// A stale worker: its claim's lease ran out (as when its process was paused
/// longer than the lease) and another worker took the stage over and succeeded.
/// When the stale one goes on, its commit is fenced: the fence is checked before
/// the body's writes, so its body never even ran, and the pages and translations
/// are those of the new holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_attempt_writes_nothing_after_a_takeover() {
    let mut f = fixture().await;
    // A heartbeat far away: nothing renews the stale claim during the test.
    let policy = ocr_translate::ocr_policy()
        .with_lease(Duration::from_secs(120))
        .with_heartbeat(Duration::from_secs(60));
    let ocr = HeldOnce::new(Ocr::new(None).with_policy(policy.clone()));
    let translate = HeldOnce::new(Translate::new(None).with_policy(policy));
    let pipeline = Pipeline::builder(ocr.clone())
        .then(translate.clone())
        .build()
        .unwrap();
    let job = f.item(&pipeline, &tenant("acme"), TEXT_1).await;

    for (stage, held) in [(OCR, &ocr.hold), (TRANSLATE, &translate.hold)] {
        let stale = {
            let (exec, pipeline, job) = (f.executor(), pipeline.clone(), job.clone());
            tokio::spawn(async move {
                let stage = pipeline.stage(stage).unwrap().clone();
                exec.run(&pipeline, &stage, &job).await.unwrap()
            })
        };
        held.started.notified().await;
        // The stale worker's lease runs out (on the database clock).
        diesel::sql_query(format!(
            "UPDATE stage_runs SET lease_expires_at = clock_timestamp() - interval '1 second'
              WHERE item_id = '{}' AND stage = '{stage}' AND status = 'running'",
            job.item_id
        ))
        .execute(&mut f.conn)
        .await
        .unwrap();
        let takeover = f
            .executor()
            .run(&pipeline, pipeline.stage(stage).unwrap(), &job)
            .await
            .unwrap();
        assert!(
            matches!(takeover, ExecutionOutcome::Succeeded { attempt: 2, .. }),
            "{stage}: {takeover:?}"
        );
        held.release.notify_one();
        let outcome = stale.await.unwrap();
        assert_eq!(outcome, ExecutionOutcome::Fenced { attempt: 1 }, "{stage}");
        assert_eq!(held.bodies(), 1, "{stage}: only the new holder's body ran");
    }
    assert_eq!(f.pages(&job).await, expected_pages(&PAGES_1, 2));
    assert_eq!(
        f.translations(&job).await,
        expected_translations(&PAGES_1, 2, 2)
    );
    assert_eq!(
        f.count_for(
            &job,
            "SELECT 1 FROM audit_log WHERE run_id IS NOT NULL AND attempt <> 2"
        )
        .await,
        0
    );
    assert_eq!(
        f.count_for(&job, "SELECT 1 FROM jobs WHERE queue = 'translate'")
            .await,
        1
    );
}
