//! Fault injection: each test injects one kind of fault into real worker processes
//! (or in-process workers, where the fault is inside the process) on a real
//! PostgreSQL, stops the fault, waits until every item is final and no job is
//! live, and then checks the invariants with SQL only (`check_example_pipeline`):
//! one success per (tenant, item, stage), nothing lost, children, files and
//! audit entries only from successful attempts, a consistent attempt history.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage::{db::PgPool, db::PoolConfig};
use idemstage::{ids::ItemId, ids::TenantId, queue::SendResult, stage::StagePolicy};
use idemstage::{pipeline::Pipeline, stage::StageJob};
use idemstage::{worker::Counters, worker::WorkerStatsSnapshot};
use idemstage_example::{self as example, Chaos};
use idemstage_harness::PrivateCluster;
use rand::Rng;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::support::{
    self, assert_quiet_and_sound, count, enqueue, signal, wait_until, Workers, JOB_LEASE_MS,
    STAGE_LEASE_MS,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_random_sigkills_lose_nothing_and_run_nothing_twice() {
    let db = idemstage_harness::example::db().await;
    let n = 80;
    enqueue(db.url(), n).await;
    // The delay keeps claims open between claim and commit (and transactions open),
    // so that kills land there too.
    let mut workers = Workers::start(
        db.url(),
        3,
        &["--stage-delay-ms", "300", "--crash-rate", "0.03"],
    );
    let mut kills = 0;
    let mut conn = db.conn().await;
    while kills < 8 {
        let pause = rand::rng().random_range(200..900);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let succeeded = count(
            &mut conn,
            "SELECT 1 FROM stage_runs WHERE status = 'success'",
        )
        .await;
        if succeeded as usize >= n * 4 {
            break;
        }
        let victim = rand::rng().random_range(0..workers.children.len());
        workers.kill_and_replace(victim);
        kills += 1;
    }
    assert!(kills >= 3, "the work ended before the faults could hit it");
    let check = assert_quiet_and_sound(db.url(), 180).await;
    workers.assert_all_alive();
    workers.stop_all();
    assert_eq!(check.items, n as i64);
    assert_eq!(check.stages_succeeded, (n * 4) as i64);
    // Killed workers held claims: those attempts were given up and taken over.
    assert!(check.abandoned >= 1, "no kill hit a held claim: {check:?}");
}

#[derive(diesel::QueryableByName, Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct AttemptRow {
    #[diesel(sql_type = Text)]
    run_id: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Text)]
    outcome: String,
}

async fn attempts(conn: &mut AsyncPgConnection, filter: &str) -> Vec<AttemptRow> {
    let mut rows: Vec<AttemptRow> = diesel::sql_query(format!(
        "SELECT run_id, attempt, outcome FROM stage_run_attempts WHERE {filter}"
    ))
    .load(conn)
    .await
    .unwrap();
    rows.sort();
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_past_its_lease_is_fenced_after_sigcont() {
    let db = idemstage_harness::example::db().await;
    enqueue(db.url(), 12).await;
    let mut conn = db.conn().await;
    // Worker A alone, with a long body, so that it holds claims when stopped; and
    // stopped while inside a transaction (so it also holds a stage's row lock,
    // which must not block the stage forever).
    let mut a = Workers::start(db.url(), 1, &["--stage-delay-ms", "3000"]);
    let mut frozen = Vec::new();
    let in_tx = "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() \
                 AND state = 'idle in transaction'";
    for _ in 0..50 {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while count(&mut conn, in_tx).await == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "A never held a transaction"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        signal(&a.children[0], "-STOP");
        // A is the only worker and is stopped: the running attempts are its, frozen.
        frozen = attempts(&mut conn, "outcome = 'running'").await;
        if !frozen.is_empty() && count(&mut conn, in_tx).await > 0 {
            break;
        }
        frozen.clear();
        signal(&a.children[0], "-CONT");
    }
    assert!(
        !frozen.is_empty(),
        "could not stop A inside a transaction while it held a claim"
    );

    // B takes over once A's stage leases and job leases have run out.
    let mut b = Workers::start(db.url(), 1, &[]);
    assert_quiet_and_sound(db.url(), 120).await;
    let taken_over = attempts(&mut conn, "true").await;
    for f in &frozen {
        let now = taken_over
            .iter()
            .find(|r| r.run_id == f.run_id && r.attempt == f.attempt)
            .unwrap();
        assert_eq!(now.outcome, "abandoned", "{f:?} while A is stopped");
        assert!(
            taken_over
                .iter()
                .any(|r| r.run_id == f.run_id && r.attempt > f.attempt && r.outcome == "success"),
            "{f:?} was not taken over by a later attempt"
        );
    }

    // A wakes up past its lease: whatever it was doing must be refused.
    signal(&a.children[0], "-CONT");
    // Stop B, then send more work: only A is left, so A must be alive and working.
    b.stop_all();
    enqueue(db.url(), 3).await;
    assert_quiet_and_sound(db.url(), 120).await;
    a.assert_all_alive();
    a.stop_all();
    let check = support::wait_until(db.url(), "final", 5, |_| true).await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.items, 15);
    assert_eq!(check.stages_succeeded, 15 * 4);
    assert_eq!(check.double_executions, 0);
    let after = attempts(&mut conn, "true").await;
    for f in &frozen {
        let row = after
            .iter()
            .find(|r| r.run_id == f.run_id && r.attempt == f.attempt)
            .unwrap();
        assert!(
            row.outcome == "fenced" || row.outcome == "abandoned",
            "stale attempt {row:?}"
        );
    }
    // Nothing that a frozen attempt could have written exists.
    for f in &frozen {
        let writes = count(
            &mut conn,
            &format!(
                "SELECT 1 FROM audit_log WHERE run_id = '{0}' AND attempt = {1}
                 UNION ALL SELECT 1 FROM anfrage_extraktionen WHERE run_id = '{0}' AND attempt = {1}
                 UNION ALL SELECT 1 FROM feasibility_results WHERE run_id = '{0}' AND attempt = {1}
                 UNION ALL SELECT 1 FROM calculation_results WHERE run_id = '{0}' AND attempt = {1}",
                f.run_id, f.attempt
            ),
        )
        .await;
        assert_eq!(writes, 0, "a stale attempt wrote: {f:?}");
    }
}

/// Terminates backends of the database chosen by `pick` (a query returning `pid`s)
/// every few milliseconds until `kills` were terminated or `stop` says so; returns
/// how many were terminated.
async fn terminator(
    url: String,
    pick: &'static str,
    kills: u64,
    every_ms: std::ops::Range<u64>,
    stop: CancellationToken,
) -> u64 {
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = idemstage::db::connect(&url).await.unwrap();
    let mut done = 0;
    while done < kills && !stop.is_cancelled() {
        let pause = rand::rng().random_range(every_ms.clone());
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let n: N = diesel::sql_query(format!(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n FROM ({pick}) p"
        ))
        .get_result(&mut conn)
        .await
        .unwrap();
        done += n.n as u64;
    }
    done
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_mid_transaction_lose_nothing() {
    let db = idemstage_harness::example::db().await;
    enqueue(db.url(), 50).await;
    let mut workers = Workers::start(db.url(), 2, &["--stage-delay-ms", "400"]);
    // Client backends in a transaction (idle in it, or running a statement of it),
    // and now and then an idle pooled or listening one.
    let pick = "SELECT pid FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()
                   AND backend_type = 'client backend'
                   AND (state = 'idle in transaction'
                        OR (state = 'active' AND xact_start IS NOT NULL)
                        OR (state = 'idle' AND random() < 0.1))
                 ORDER BY random() LIMIT 1";
    let killed = terminator(
        db.url().to_owned(),
        pick,
        30,
        10..80,
        CancellationToken::new(),
    )
    .await;
    assert_eq!(killed, 30);
    let check = assert_quiet_and_sound(db.url(), 180).await;
    workers.assert_all_alive();
    workers.stop_all();
    assert_eq!(check.stages_succeeded, 50 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_terminated_during_commit_are_rechecked_not_lost() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    // A deferred constraint trigger makes every completion's COMMIT take a while, so
    // that the connection can be terminated while the server is inside COMMIT.
    conn.batch_execute(
        "CREATE FUNCTION test_slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.status = 'success' THEN PERFORM pg_sleep(0.2); END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER test_slow_commit AFTER UPDATE ON stage_runs
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_slow_commit();",
    )
    .await
    .unwrap();
    enqueue(db.url(), 30).await;
    let mut workers = Workers::start(db.url(), 2, &[]);
    let pick = "SELECT pid FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()
                   AND state = 'active' AND query = 'COMMIT' AND wait_event = 'PgSleep'";
    let killed = terminator(
        db.url().to_owned(),
        pick,
        12,
        5..20,
        CancellationToken::new(),
    )
    .await;
    assert!(killed >= 12);
    let check = assert_quiet_and_sound(db.url(), 180).await;
    workers.assert_all_alive();
    workers.stop_all();
    assert_eq!(check.stages_succeeded, 30 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_run_loses_nothing() {
    let cluster = PrivateCluster::start();
    let url = cluster.url("postgres");
    idemstage::db::migrate_with(&url, vec![idemstage_example::MIGRATIONS])
        .await
        .unwrap();
    idemstage_testkit::ensure_test_roles(&url).await;
    enqueue(&url, 60).await;
    let mut workers = Workers::start(&url, 2, &["--stage-delay-ms", "200"]);
    for round in 1..=2 {
        wait_until(&url, "work under way", 120, |c| {
            c.stages_succeeded >= 40 * round
        })
        .await;
        cluster.restart();
    }
    let check = assert_quiet_and_sound(&url, 180).await;
    workers.assert_all_alive();
    workers.stop_all();
    assert_eq!(check.stages_succeeded, 60 * 4);
}

/// An in-process stage worker over the example pipeline with the processes' leases.
fn start_worker(
    pool: PgPool,
    url: &str,
    concurrency: usize,
    chaos: Chaos,
    counters: Arc<Counters>,
) -> (CancellationToken, JoinHandle<WorkerStatsSnapshot>) {
    let policy = StagePolicy::default()
        .with_lease(Duration::from_millis(STAGE_LEASE_MS))
        .with_heartbeat(Duration::from_millis(STAGE_LEASE_MS / 3));
    let mut send = Pipeline::default_send_options();
    send.expire_in = Duration::from_millis(JOB_LEASE_MS);
    let pipeline = example::pipeline_with(chaos, policy)
        .unwrap()
        .with_send_options(send)
        .unwrap();
    support::start_pipeline_worker(pool, url, pipeline, concurrency, counters)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_concurrent_stages_than_pooled_connections_lose_nothing() {
    let db = idemstage_harness::example::db().await;
    enqueue(db.url(), 40).await;
    // 8 stage executions (each wants a connection for its work and one for its
    // heartbeat, plus the job lease renewals) share 2 connections, and give up
    // waiting for one after 200 ms.
    let pool = idemstage::db::connect_pool(
        db.url(),
        PoolConfig::default()
            .with_max_size(2)
            .with_connection_timeout(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let counters = Arc::new(Counters::tracking_successes());
    let chaos = Chaos {
        crash_rate: 0.0,
        delay_ms: 100,
    };
    let (stop, handle) = start_worker(pool, db.url(), 8, chaos, counters.clone());
    let check = assert_quiet_and_sound(db.url(), 180).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("worker did not stop")
        .unwrap();
    assert_eq!(check.stages_succeeded, 40 * 4);
    assert_eq!(counters.double_successes(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_sends_racing_completion_run_each_stage_once() {
    let db = idemstage_harness::example::db().await;
    let n = 30;
    let keys: Vec<(TenantId, ItemId, String)> = (0..n)
        .map(|i| {
            (
                TenantId::parse(&format!("t{}", i % 3)).unwrap(),
                ItemId::new(),
                support::text(i),
            )
        })
        .collect();
    let counters = Arc::new(Counters::tracking_successes());
    let mut running = Vec::new();
    for _ in 0..2 {
        running.push(start_worker(
            db.pool(10).await,
            db.url(),
            4,
            Chaos::default(),
            counters.clone(),
        ));
    }
    let sent = Arc::new(AtomicU64::new(0));
    let duplicate = Arc::new(AtomicU64::new(0));
    let keys = Arc::new(keys);
    let mut senders = Vec::new();
    for s in 0..4 {
        let (url, keys, sent, duplicate) = (
            db.url().to_owned(),
            keys.clone(),
            sent.clone(),
            duplicate.clone(),
        );
        senders.push(tokio::spawn(async move {
            let mut conn = idemstage::db::connect(&url).await.unwrap();
            let pipeline = support::pipeline();
            let extract = idemstage::ids::StageName::parse("extract").unwrap();
            for round in 0..12 {
                for k in 0..keys.len() {
                    // Each sender walks the keys from another start: the same key is
                    // sent from several connections at nearly the same time.
                    let (tenant, item, text) = &keys[(k + round + s * 7) % keys.len()];
                    let mut results = vec![support::send(&mut conn, tenant, *item, text).await];
                    // And the next stage's job, racing the one that intake's
                    // completion sends in its transaction.
                    if round % 2 == 1 {
                        let job = pipeline.job_for(
                            &extract,
                            &StageJob {
                                tenant_id: tenant.clone(),
                                item_id: *item,
                                input_hash: idemstage::ids::input_hash_of(text.as_bytes()),
                            },
                        );
                        results.push(idemstage::queue::send_in(&mut conn, &job).await.unwrap());
                    }
                    for r in results {
                        match r {
                            SendResult::Sent(_) => sent.fetch_add(1, Ordering::Relaxed),
                            SendResult::Duplicate => duplicate.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                }
            }
        }));
    }
    for s in senders {
        s.await.unwrap();
    }
    let check = assert_quiet_and_sound(db.url(), 180).await;
    for (stop, handle) in running {
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), handle)
            .await
            .expect("worker did not stop")
            .unwrap();
    }
    assert_eq!(check.items, n as i64);
    assert_eq!(check.stages_succeeded, (n * 4) as i64);
    assert_eq!(counters.double_successes(), 0);
    let (sent, duplicate) = (
        AtomicU64::load(&sent, Ordering::Relaxed),
        AtomicU64::load(&duplicate, Ordering::Relaxed),
    );
    // Both sides of the race happened: refused while live, accepted again after
    // completion (and then skipped at the claim).
    assert!(duplicate > 0, "no send was refused as a duplicate");
    assert!(sent > n as u64, "no send came after a completion: {sent}");
    assert!(counters.snapshot().skipped > 0);
}
