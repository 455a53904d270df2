//! Layer 1: the claim, leases, fencing, the write helpers, and the corrections of
//! DESIGN.md section 1. Separate connections, real commits.

use idemstage_example::ExampleTables;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel_async::{AsyncConnection, SimpleAsyncConnection};
use futures_util::FutureExt;
use idemstage_domain::{
    ClaimOutcome, CompleteOutcome, FailOutcome, InputChangePolicy, RejectReason, RenewOutcome,
    RunStatus, SkipReason,
};
use idemstage_example::{insert_or_get_datei, Extraktion};
use idemstage_persistence::fenced::audit;
use rand::{Rng, SeedableRng};
use tokio::sync::Barrier;

use crate::support::*;

fn positions(n: i32, label: &str) -> Vec<Extraktion> {
    (0..n)
        .map(|i| Extraktion {
            position_index: i,
            description: format!("{label} {i}"),
            quantity: Some(f64::from(i + 1)),
            unit: Some("Stk".into()),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_claims_of_a_fresh_key_yield_exactly_one_claimed() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 64).await;
    let t = tenant("t1");
    let item = new_item(&mut db.conn().await, &t).await;
    let barrier = Arc::new(Barrier::new(64));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (repo, barrier, req) = (repo.clone(), barrier.clone(), request(&t, item, "intake"));
        tasks.push(tokio::spawn(async move {
            // Hold a connection before the barrier so the claims really overlap.
            drop(repo.pool().get().await.unwrap());
            barrier.wait().await;
            repo.claim(&req).await.unwrap()
        }));
    }
    let mut claimed = 0;
    for task in tasks {
        match task.await.unwrap() {
            ClaimOutcome::Claimed { attempt, .. } => {
                assert_eq!(attempt, 1);
                claimed += 1;
            }
            ClaimOutcome::Skipped(SkipReason::InFlight { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(claimed, 1);
    let mut conn = db.conn().await;
    assert_eq!(count(&mut conn, "SELECT * FROM stage_runs").await, 1);
    assert_eq!(
        count(&mut conn, "SELECT * FROM stage_run_attempts").await,
        1
    );
}

#[tokio::test]
async fn a_succeeded_stage_is_skipped_and_its_row_left_unchanged() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = request(&t, new_item(&mut conn, &t).await, "intake");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    let write = write_fn(noop);
    assert_eq!(
        repo.complete(&token, &write).await.unwrap(),
        CompleteOutcome::Committed
    );
    let before = repo
        .read_run(&req.tenant, &req.item, &req.stage)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(before.status, RunStatus::Success);

    let again = repo.claim(&req).await.unwrap();
    assert_eq!(
        again,
        ClaimOutcome::Skipped(SkipReason::AlreadySucceeded {
            run_id: token.run_id
        })
    );
    let after = repo
        .read_run(&req.tenant, &req.item, &req.stage)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (after.status, after.attempts, after.started_at),
        (before.status, before.attempts, before.started_at)
    );
    assert_eq!(
        count(&mut conn, "SELECT * FROM stage_run_attempts").await,
        1
    );
}

#[tokio::test]
async fn a_live_lease_is_in_flight_and_an_expired_one_is_claimed_again() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = short_lease(request(&t, new_item(&mut conn, &t).await, "extract"), 300);
    let first = token_of(&req, &repo.claim(&req).await.unwrap());

    let mut other = req.clone();
    other.worker = idemstage_domain::WorkerId::generate();
    match repo.claim(&other).await.unwrap() {
        ClaimOutcome::Skipped(SkipReason::InFlight { lease_expires_at }) => {
            let run = repo
                .read_run(&req.tenant, &req.item, &req.stage)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(lease_expires_at, run.lease_expires_at);
        }
        o => panic!("expected InFlight, got {o:?}"),
    }

    wait_lease_expired(&mut conn, &first.run_id.to_string()).await;
    let second = token_of(&other, &repo.claim(&other).await.unwrap());
    assert_eq!(second.attempt, first.attempt + 1);
    assert_eq!(second.run_id, first.run_id);
    // The old holder can neither renew nor fail any more.
    assert_eq!(
        repo.renew_lease(&first, Duration::from_secs(5))
            .await
            .unwrap(),
        RenewOutcome::Fenced
    );
    assert_eq!(
        repo.fail(&first, "late failure", true).await.unwrap(),
        FailOutcome::Fenced
    );
    let history = repo.attempt_history(&first.run_id).await.unwrap();
    let outcomes: Vec<_> = history.iter().map(|a| a.outcome.as_str()).collect();
    assert_eq!(outcomes, ["abandoned", "running"]);
}

#[tokio::test]
async fn a_stale_holder_is_fenced_and_none_of_its_writes_survive() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = short_lease(request(&t, new_item(&mut conn, &t).await, "extract"), 200);
    let stale = token_of(&req, &repo.claim(&req).await.unwrap());
    wait_lease_expired(&mut conn, &stale.run_id.to_string()).await;
    let holder = token_of(&req, &repo.claim(&req).await.unwrap());

    let writes = |label: &'static str, n: i32| {
        write_fn(move |tx| {
            async move {
                tx.replace_extraktionen(&positions(n, label)).await?;
                tx.insert_or_get_datei(&"c".repeat(64), &format!("files/{label}"), 10)
                    .await?;
                tx.audit("item", &format!("{label}.done"), serde_json::json!({}))
                    .await?;
                Ok(())
            }
            .boxed()
        })
    };
    assert_eq!(
        repo.complete(&stale, &writes("stale", 5)).await.unwrap(),
        CompleteOutcome::Fenced
    );
    assert_eq!(
        repo.complete(&holder, &writes("holder", 3)).await.unwrap(),
        CompleteOutcome::Committed
    );

    assert_eq!(
        count(&mut conn, "SELECT * FROM anfrage_extraktionen").await,
        3
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM anfrage_extraktionen WHERE attempt <> 2 OR description NOT LIKE 'holder%'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM dateien WHERE s3_key = 'files/stale'"
        )
        .await,
        0
    );
    assert_eq!(
        count(&mut conn, "SELECT * FROM audit_log WHERE attempt = 1").await,
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM audit_log WHERE action LIKE 'stale%'"
        )
        .await,
        0
    );
    let history = repo.attempt_history(&stale.run_id).await.unwrap();
    let outcomes: Vec<_> = history.iter().map(|a| a.outcome.as_str()).collect();
    assert_eq!(outcomes, ["fenced", "success"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_replacers_leave_exactly_one_child_set() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = short_lease(request(&t, new_item(&mut conn, &t).await, "extract"), 200);
    // An earlier success left 7 children; two attempts now race to replace them.
    let first = token_of(&req, &repo.claim(&req).await.unwrap());
    wait_lease_expired(&mut conn, &first.run_id.to_string()).await;
    let second = token_of(&req, &repo.claim(&req).await.unwrap());

    let barrier = Arc::new(Barrier::new(2));
    let replace = |token: idemstage_domain::ClaimToken, n: i32| {
        let (repo, barrier) = (repo.clone(), barrier.clone());
        tokio::spawn(async move {
            let write = write_fn(move |tx| {
                async move {
                    tx.replace_extraktionen(&positions(n, "set")).await?;
                    Ok(())
                }
                .boxed()
            });
            barrier.wait().await;
            repo.complete(&token, &write).await.unwrap()
        })
    };
    let a = replace(first, 5);
    let b = replace(second, 3);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert_eq!(
        (a, b),
        (CompleteOutcome::Fenced, CompleteOutcome::Committed)
    );
    assert_eq!(
        count(&mut conn, "SELECT * FROM anfrage_extraktionen").await,
        3
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT DISTINCT run_id, attempt FROM anfrage_extraktionen"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn the_per_row_upsert_variant_ends_like_replace() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = request(&t, new_item(&mut conn, &t).await, "extract");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    let write = write_fn(|tx| {
        async move {
            tx.upsert_extraktionen(&positions(6, "old")).await?;
            // A smaller second set: positions 4 and 5 must go.
            tx.upsert_extraktionen(&positions(4, "new")).await?;
            Ok(())
        }
        .boxed()
    });
    assert_eq!(
        repo.complete(&token, &write).await.unwrap(),
        CompleteOutcome::Committed
    );
    assert_eq!(
        count(&mut conn, "SELECT * FROM anfrage_extraktionen").await,
        4
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM anfrage_extraktionen WHERE description LIKE 'new%'"
        )
        .await,
        4
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn insert_or_get_under_32_concurrent_callers_returns_one_id() {
    let db = idemstage_harness::example::db().await;
    let t = tenant("t1");
    let item = new_item(&mut db.conn().await, &t).await;
    let barrier = Arc::new(Barrier::new(32));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (barrier, t, url) = (barrier.clone(), t.clone(), db.url().to_owned());
        tasks.push(tokio::spawn(async move {
            let mut conn = idemstage_persistence::connect(&url).await.unwrap();
            barrier.wait().await;
            conn.transaction::<_, idemstage_persistence::TxError, _>(async move |conn| {
                let datei = insert_or_get_datei(
                    conn,
                    &t,
                    &item.to_string(),
                    &"d".repeat(64),
                    "files/input.pdf",
                    42,
                )
                .await?;
                audit(
                    conn,
                    &t,
                    &datei.id.to_string(),
                    "datei.seen",
                    None,
                    serde_json::json!({}),
                )
                .await?;
                Ok(datei)
            })
            .await
            .unwrap()
        }));
    }
    let mut ids = Vec::new();
    let mut inserted = 0;
    for task in tasks {
        let datei = task.await.unwrap();
        inserted += usize::from(datei.inserted);
        ids.push(datei.id);
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(inserted, 1);
    let mut conn = db.conn().await;
    assert_eq!(count(&mut conn, "SELECT * FROM dateien").await, 1);
    let id = ids[0].to_string();
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT * FROM audit_log WHERE entity_id = '{id}'")
        )
        .await,
        32
    );
    assert_eq!(count(&mut conn, "SELECT * FROM audit_log").await, 32);
}

#[tokio::test]
async fn max_attempts_reached_is_exhausted_and_never_claimed_again() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let mut req = request(&t, new_item(&mut conn, &t).await, "calculate");
    req.policy.max_attempts = 2;
    let first = token_of(&req, &repo.claim(&req).await.unwrap());
    assert_eq!(
        repo.fail(&first, "boom 1", true).await.unwrap(),
        FailOutcome::WillRetry { attempt: 1 }
    );
    let second = token_of(&req, &repo.claim(&req).await.unwrap());
    assert_eq!(second.attempt, 2);
    assert_eq!(
        repo.fail(&second, "boom 2", true).await.unwrap(),
        FailOutcome::Exhausted { attempts: 2 }
    );
    for _ in 0..3 {
        assert_eq!(
            repo.claim(&req).await.unwrap(),
            ClaimOutcome::Exhausted { attempts: 2 }
        );
    }
    let run = repo
        .read_run(&req.tenant, &req.item, &req.stage)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((run.status, run.attempts), (RunStatus::Dead, 2));
    assert_eq!(run.last_error.as_deref(), Some("boom 2"));

    // The lease path: a holder that vanished on its last attempt ends the run too.
    let mut req = short_lease(request(&t, new_item(&mut conn, &t).await, "calculate"), 100);
    req.policy.max_attempts = 1;
    let only = token_of(&req, &repo.claim(&req).await.unwrap());
    wait_lease_expired(&mut conn, &only.run_id.to_string()).await;
    assert_eq!(
        repo.claim(&req).await.unwrap(),
        ClaimOutcome::Exhausted { attempts: 1 }
    );
    let run = repo
        .read_run(&req.tenant, &req.item, &req.stage)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(run.status, RunStatus::Dead);
}

#[tokio::test]
async fn a_permanent_failure_is_dead_at_once() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let req = request(&t, new_item(&mut conn, &t).await, "calculate");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    assert_eq!(
        repo.fail(&token, "unparseable", false).await.unwrap(),
        FailOutcome::Exhausted { attempts: 1 }
    );
    assert_eq!(
        repo.claim(&req).await.unwrap(),
        ClaimOutcome::Exhausted { attempts: 1 }
    );
}

#[tokio::test]
async fn input_binding_rejects_or_reruns_by_policy() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let item = new_item(&mut conn, &t).await;
    let write = write_fn(noop);
    for (name, upstream) in [("intake", None), ("extract", Some(stage("intake")))] {
        let mut req = request(&t, item, name);
        req.upstream = upstream;
        let token = token_of(&req, &repo.claim(&req).await.unwrap());
        repo.complete(&token, &write).await.unwrap();
    }

    // Same input: skip. Other input, default policy: reject, nothing changes.
    let mut changed = request(&t, item, "intake");
    assert!(matches!(
        repo.claim(&changed).await.unwrap(),
        ClaimOutcome::Skipped(SkipReason::AlreadySucceeded { .. })
    ));
    replace_input(&mut conn, item, TEXT_B).await;
    changed.input_hash = hash_b();
    assert_eq!(
        repo.claim(&changed).await.unwrap(),
        ClaimOutcome::Rejected(RejectReason::InputChanged {
            stored_hash: hash_a(),
            new_hash: hash_b(),
        })
    );

    // Rerun policy: the stage is claimed again; its downstream stays as it is until
    // the rerun succeeds (a failed rerun invalidates nothing), then it is stale.
    changed.policy.on_input_change = InputChangePolicy::Rerun;
    let rerun = token_of(&changed, &repo.claim(&changed).await.unwrap());
    assert_eq!(rerun.attempt, 2);
    let extract_status = async || {
        repo.read_run(&t, &item, &stage("extract"))
            .await
            .unwrap()
            .unwrap()
            .status
    };
    assert_eq!(extract_status().await, RunStatus::Success);
    repo.complete(&rerun, &write).await.unwrap();
    assert_eq!(extract_status().await, RunStatus::Stale);
    let mut extract_req = request(&t, item, "extract");
    extract_req.upstream = Some(stage("intake"));
    assert!(matches!(
        repo.claim(&extract_req).await.unwrap(),
        ClaimOutcome::Claimed { attempt: 2, upstream_attempt: Some(2), ref input_hash, .. }
            if *input_hash == hash_b()
    ));
}

#[tokio::test]
async fn a_claim_for_an_unknown_item_is_a_typed_error() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 2).await;
    let mut conn = db.conn().await;
    let owner = tenant("owner");
    let item = new_item(&mut conn, &owner).await;
    // Another tenant naming that item gets nothing and writes nothing.
    let req = request(&tenant("intruder"), item, "intake");
    let err = repo.claim(&req).await.unwrap_err();
    assert!(
        matches!(err, idemstage_domain::RepoError::ItemNotFound { .. }),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert_eq!(count(&mut conn, "SELECT * FROM stage_runs").await, 0);
}

/// Correction 6: a deadlock (40P01) between two completions is retried, never
/// reported as a skip or a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_between_two_completions_is_retried() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 4).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let barrier = Arc::new(Barrier::new(2));
    let mut tasks = Vec::new();
    for (first, second) in [("k1", "k2"), ("k2", "k1")] {
        let req = request(&t, new_item(&mut conn, &t).await, "intake");
        let token = token_of(&req, &repo.claim(&req).await.unwrap());
        let (repo, barrier) = (repo.clone(), barrier.clone());
        let runs = Arc::new(AtomicU32::new(0));
        tasks.push(tokio::spawn(async move {
            let (b, r) = (barrier.clone(), runs.clone());
            let write = write_fn(move |tx| {
                let (barrier, runs) = (b.clone(), r.clone());
                async move {
                    let run = AtomicU32::fetch_add(&runs, 1, Ordering::SeqCst);
                    tx.insert_or_get_datei(&"e".repeat(64), first, 1).await?;
                    if run == 0 {
                        // Both hold their first key before taking the other's.
                        barrier.wait().await;
                    }
                    tx.insert_or_get_datei(&"e".repeat(64), second, 1).await?;
                    Ok(())
                }
                .boxed()
            });
            let outcome = repo.complete(&token, &write).await.unwrap();
            (outcome, AtomicU32::load(&runs, Ordering::SeqCst))
        }));
    }
    let mut total_runs = 0;
    for task in tasks {
        let (outcome, runs) = task.await.unwrap();
        assert_eq!(outcome, CompleteOutcome::Committed);
        total_runs += runs;
    }
    assert_eq!(total_runs, 3, "one of the two transactions ran twice");
    assert_eq!(count(&mut conn, "SELECT * FROM dateien").await, 2);
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM stage_runs WHERE status = 'success'"
        )
        .await,
        2
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM stage_run_attempts WHERE outcome = 'success'"
        )
        .await,
        2
    );
}

/// Correction 6: the connection dies during COMMIT. The executor must re-read the
/// run: here the commit did not happen, so the transaction is run again, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_during_commit_is_rechecked_and_retried() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    // A deferred trigger makes COMMIT itself slow, so the connection can be killed
    // exactly while COMMIT is in progress.
    conn.batch_execute(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON audit_log
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
           WHEN (NEW.action = 'slow.commit') EXECUTE FUNCTION slow_commit();",
    )
    .await
    .unwrap();
    let repo = repo(&db, 4).await;
    let t = tenant("t1");
    let req = request(&t, new_item(&mut conn, &t).await, "intake");
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    let first = Arc::new(AtomicBool::new(true));
    let runs = Arc::new(Mutex::new(Vec::new()));
    let (f, r) = (first.clone(), runs.clone());
    let write = write_fn(move |tx| {
        let action = if f.swap(false, Ordering::SeqCst) {
            "slow.commit"
        } else {
            "quick.commit"
        };
        r.lock().unwrap().push(action);
        async move {
            tx.audit("item", action, serde_json::json!({})).await?;
            Ok(())
        }
        .boxed()
    });
    let killer = {
        let url = db.url().to_owned();
        tokio::spawn(async move {
            let mut conn = idemstage_persistence::connect(&url).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            loop {
                let killed = count(
                    &mut conn,
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event = 'PgSleep'
                       AND query ILIKE '%commit%'",
                )
                .await;
                if killed > 0 {
                    return;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "COMMIT never started"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let outcome = repo.complete(&token, &write).await.unwrap();
    killer.await.unwrap();
    assert_eq!(outcome, CompleteOutcome::Committed);
    assert_eq!(*runs.lock().unwrap(), ["slow.commit", "quick.commit"]);
    let mut conn = db.conn().await;
    assert_eq!(count(&mut conn, "SELECT * FROM audit_log").await, 1);
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM audit_log WHERE action = 'quick.commit'"
        )
        .await,
        1
    );
    let run = repo
        .read_run(&req.tenant, &req.item, &req.stage)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((run.status, run.attempts), (RunStatus::Success, 1));
}

/// 16 tasks × 2,000 random claims over 200 keys with random success, failure and
/// abandonment; afterwards every key has at most one success and the attempt
/// history matches `attempts` exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stress_random_claims_keep_every_invariant() {
    const TASKS: usize = 16;
    const CLAIMS: usize = 2_000;
    const KEYS: usize = 200;
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, TASKS as u32).await;
    let mut conn = db.conn().await;
    let t = tenant("stress");
    let mut items = Vec::new();
    for _ in 0..KEYS / 4 {
        items.push(new_item(&mut conn, &t).await);
    }
    let seed: u64 = rand::random();
    eprintln!("stress seed {seed}");
    let committed: Arc<Mutex<HashMap<(usize, usize), u32>>> = Arc::default();
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let (repo, t, items, committed) =
            (repo.clone(), t.clone(), items.clone(), committed.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ task as u64);
            let stages = ["intake", "extract", "feasibility", "calculate"];
            for _ in 0..CLAIMS {
                let (a, s) = (rng.random_range(0..items.len()), rng.random_range(0..4));
                let mut req = short_lease(request(&t, items[a], stages[s]), 30);
                req.policy.max_attempts = 100_000;
                let outcome = repo.claim(&req).await.unwrap();
                let ClaimOutcome::Claimed { .. } = outcome else {
                    continue;
                };
                let token = token_of(&req, &outcome);
                match rng.random_range(0..10) {
                    0..=3 => {
                        let write = write_fn(|tx| {
                            async move {
                                tx.audit("x", "done", serde_json::json!({})).await?;
                                Ok(())
                            }
                            .boxed()
                        });
                        if repo.complete(&token, &write).await.unwrap()
                            == CompleteOutcome::Committed
                        {
                            *committed.lock().unwrap().entry((a, s)).or_default() += 1;
                        }
                    }
                    4..=7 => {
                        repo.fail(&token, "random failure", true).await.unwrap();
                    }
                    _ => {} // abandon: the lease runs out
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let committed = committed.lock().unwrap().clone();
    assert!(committed.values().all(|&n| n == 1), "{committed:?}");
    assert!(!committed.is_empty());
    // Plain SQL invariants.
    assert_eq!(
        count(
            &mut conn,
            "SELECT run_id FROM stage_run_attempts WHERE outcome = 'success'
             GROUP BY run_id HAVING count(*) > 1"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs r
             WHERE r.attempts <> (SELECT count(*) FROM stage_run_attempts a WHERE a.run_id = r.id)
                OR r.attempts <> (SELECT max(attempt) FROM stage_run_attempts a WHERE a.run_id = r.id)"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT * FROM stage_runs WHERE status = 'success'"
        )
        .await as usize,
        committed.len()
    );
    // Exactly one audit row per committed success, written by the successful attempt.
    assert_eq!(
        count(&mut conn, "SELECT * FROM audit_log").await as usize,
        committed.len()
    );
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM audit_log l JOIN stage_runs r ON r.id = l.run_id
             WHERE r.status <> 'success' OR r.attempts <> l.attempt"
        )
        .await,
        0
    );
}

/// Duplicate sends register the same item and send its job from many
/// connections at once, each in one transaction as `idemstage enqueue` does: all
/// succeed, one creates it, one job is sent. The demo once failed here with a
/// unique violation on `items_tenant_id_uq` while the insert's conflict target
/// was the primary key alone; now any conflict counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_registrations_of_one_item_all_succeed_once() {
    let db = idemstage_harness::example::db().await;
    let t = tenant("t1");
    for _ in 0..10 {
        let item = idemstage_domain::ItemId::new();
        let barrier = Arc::new(Barrier::new(16));
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (barrier, t, url) = (barrier.clone(), t.clone(), db.url().to_owned());
            tasks.push(tokio::spawn(async move {
                let mut conn = idemstage_persistence::connect(&url).await.unwrap();
                barrier.wait().await;
                conn.transaction::<_, idemstage_persistence::TxError, _>(async |conn| {
                    let registered =
                        idemstage_persistence::items::register_item(conn, &t, &item, "1 Stk")
                            .await?;
                    // The scope of register_item lasts to the end of this
                    // transaction: the job is the scope's tenant's (the baseline migration).
                    let job = idemstage_domain::JobToSend {
                        tenant: Some(t.clone()),
                        queue: "intake".into(),
                        payload: serde_json::json!({
                            "tenant_id": "t1", "item_id": item.to_string()
                        }),
                        options: idemstage_domain::SendOptions::default()
                            .with_singleton_key(format!("intake:t1:{item}")),
                    };
                    idemstage_persistence::queue::send_in(conn, &job).await?;
                    Ok(registered)
                })
                .await
                .unwrap()
            }));
        }
        let mut created = 0;
        for task in tasks {
            if matches!(
                task.await.unwrap(),
                idemstage_persistence::items::RegisterOutcome::Created { .. }
            ) {
                created += 1;
            }
        }
        assert_eq!(created, 1);
    }
    let mut conn = db.conn().await;
    assert_eq!(count(&mut conn, "SELECT * FROM items").await, 10);
    assert_eq!(count(&mut conn, "SELECT * FROM jobs").await, 10);
}

/// Item 7: a job whose hash is not the item's stored input hash (crafted, or the
/// same hash in upper case) used to be claimed and bind that hash; the genuine job
/// was then refused with `InputChanged` for good. Now it binds nothing.
#[tokio::test]
async fn a_job_hash_that_is_not_the_stored_input_binds_nothing() {
    let db = idemstage_harness::example::db().await;
    let repo = repo(&db, 2).await;
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let item = new_item(&mut conn, &t).await;
    for crafted in [hash_b(), hash_a().to_uppercase()] {
        let mut req = request(&t, item, "intake");
        req.input_hash = crafted.clone();
        let outcome = repo.claim(&req).await.unwrap();
        assert!(
            format!("{outcome:?}").contains("InputMismatch"),
            "{crafted}: {outcome:?}"
        );
        assert_eq!(count(&mut conn, "SELECT * FROM stage_runs").await, 0);
    }
    let genuine = request(&t, item, "intake");
    let token = token_of(&genuine, &repo.claim(&genuine).await.unwrap());
    repo.complete(&token, &write_fn(noop)).await.unwrap();
    let run = repo
        .read_run(&t, &item, &stage("intake"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((run.status, run.input_hash), (RunStatus::Success, hash_a()));
}

/// Item 9: leases come from the statement's clock. A claim that waited on a row
/// lock for longer than its lease used to return a lease measured from its
/// transaction's start: already expired when it was handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_on_a_row_lock_gets_a_lease_from_after_the_wait() {
    use diesel::sql_types::Timestamptz;
    use diesel_async::RunQueryDsl;
    let db = idemstage_harness::example::db().await;
    let repo = Arc::new(repo(&db, 2).await);
    let mut conn = db.conn().await;
    let t = tenant("t1");
    let item = new_item(&mut conn, &t).await;
    let req = short_lease(request(&t, item, "intake"), 1000);
    let token = token_of(&req, &repo.claim(&req).await.unwrap());
    repo.fail(&token, "first attempt failed", true)
        .await
        .unwrap();
    // Another session holds the run's row lock while the next claim comes in.
    let mut holder = db.conn().await;
    holder
        .batch_execute(&format!(
            "BEGIN; UPDATE stage_runs SET last_error = 'held' WHERE id = '{}'",
            token.run_id
        ))
        .await
        .unwrap();
    let claim = tokio::spawn({
        let (repo, req) = (repo.clone(), req.clone());
        async move { repo.claim(&req).await.unwrap() }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(
        &mut conn,
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
    )
    .await
        == 0
    {
        assert!(tokio::time::Instant::now() < deadline, "the claim never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The wait itself, longer than the 1 s lease, is what is under test.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    #[derive(diesel::QueryableByName)]
    struct At {
        #[diesel(sql_type = Timestamptz)]
        at: chrono::DateTime<chrono::Utc>,
    }
    let released: At = diesel::sql_query("SELECT clock_timestamp() AS at")
        .get_result(&mut holder)
        .await
        .unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    let ClaimOutcome::Claimed {
        lease_expires_at, ..
    } = claim.await.unwrap()
    else {
        panic!("the claim after the lock was released must claim");
    };
    assert!(
        lease_expires_at > released.at,
        "lease {lease_expires_at} ended before the claim got it ({})",
        released.at
    );
}
