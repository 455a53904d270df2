//! Stages that lost their job: a job squatting on a stage's singleton key, a job
//! deleted by hand. The reconciler of the `PipelineWorker` sends their jobs again.

use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{Jsonb, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, JobId, TenantId};
use idemstage_runner::{Counters, PipelineWorker, PipelineWorkerConfig, QueueWorkerConfig};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::support::{self, count};

/// A job row written by hand, as a foreign producer (or a hostile one) might;
/// fetchable 3 s from now, so that it is still live when the stage before it
/// succeeds.
async fn insert_job(
    conn: &mut AsyncPgConnection,
    queue: &str,
    tenant: &str,
    key: &str,
    payload: Value,
) -> Result<JobId, diesel::result::Error> {
    let id = JobId::new();
    diesel::sql_query(
        "INSERT INTO jobs (id, queue, tenant_id, singleton_key, payload, retry_limit, start_after)
         VALUES ($1, $2, $3, $4, $5, 3, now() + interval '3 seconds')",
    )
    .bind::<Text, _>(id.to_string())
    .bind::<Text, _>(queue)
    .bind::<Text, _>(tenant)
    .bind::<Text, _>(key)
    .bind::<Jsonb, _>(payload)
    .execute(conn)
    .await?;
    Ok(id)
}

fn worker(
    pool: idemstage_persistence::PgPool,
    url: &str,
    config: PipelineWorkerConfig,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let worker = PipelineWorker::new(
        pool,
        url,
        support::pipeline(),
        config,
        Arc::new(Counters::default()),
    )
    .unwrap();
    let stop = CancellationToken::new();
    let handle = tokio::spawn({
        let stop = stop.clone();
        async move {
            worker.run(stop).await;
        }
    });
    (stop, handle)
}

fn fast_queue() -> QueueWorkerConfig {
    QueueWorkerConfig::default()
        .with_poll_interval(Duration::from_millis(200))
        .with_maintenance_interval(Duration::from_millis(1000))
}

/// The squatter: a job on `extract` under extract's singleton key whose
/// payload is no valid stage job (here: a hash that is no hash). It makes the real
/// send of extract `Duplicate`, then fails for good; before the reconciler, extract
/// stayed "not started" with no live job for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_whose_key_a_failing_job_held_runs_after_all() {
    let db = support::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    let key = format!("extract:{tenant}:{item}");
    insert_job(
        &mut conn,
        "extract",
        "t1",
        &key,
        json!({ "tenant_id": "t1", "item_id": item.to_string(), "input_hash": "squat" }),
    )
    .await
    .unwrap();
    support::send(&mut conn, &tenant, item, &support::text(1)).await;

    let w = worker(
        db.pool(12).await,
        db.url(),
        PipelineWorkerConfig::default()
            .with_concurrency(2)
            .with_queue(fast_queue())
            .with_reconcile_interval(Some(Duration::from_millis(300))),
    );
    let check = support::wait_until(db.url(), "every stage final", 60, |c| {
        c.items_final == 1 && c.live_jobs == 0
    })
    .await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    assert_eq!(check.stages_succeeded, 4, "{check:?}");
    // The squatter failed for good; the stage ran all the same.
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT 1 FROM job_states WHERE singleton_key = '{key}' AND state = 'failed'")
        )
        .await,
        1
    );
    w.0.cancel();
    w.1.await.unwrap();
}

async fn open_items(conn: &mut AsyncPgConnection) -> i64 {
    count(conn, "SELECT 1 FROM items_open").await
}

/// Polls until `sql` counts `n` rows; panics after `secs`.
async fn wait_count(conn: &mut AsyncPgConnection, sql: &str, n: i64, secs: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let got = count(conn, sql).await;
        if got == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{sql}: {got} rows, not {n}, after {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The issue's own squatter (a payload that is no stage job, no tenant label)
/// and one naming another item are refused at the door: the stage's key is
/// the stage job's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cannot_squat_on_another_stage_jobs_key() {
    let db = support::db().await;
    let mut conn = db.conn().await;
    let item = ItemId::new();
    let key = format!("extract:t1:{item}");
    for (label, payload) in [
        ("", json!({ "not": "a stage job" })),
        ("t1", json!({ "tenant_id": "t1" })),
        (
            "t1",
            json!({ "tenant_id": "t1", "item_id": ItemId::new().to_string() }),
        ),
        (
            "t2",
            json!({ "tenant_id": "t2", "item_id": item.to_string() }),
        ),
    ] {
        let err = insert_job(&mut conn, "extract", label, &key, payload.clone())
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("is the key of the stage job of tenant t1"),
            "{payload}: {err}"
        );
    }
    assert_eq!(count(&mut conn, "SELECT 1 FROM jobs").await, 0);
    assert_eq!(open_items(&mut conn).await, 0);
}

/// A stage whose job was deleted by hand (here while its queue was paused) runs
/// again once the reconciler looks, with the default interval of 30 s: the
/// time from the deletion to the stage's success is printed (the measurement of
/// RELIABILITY.md). The worker logs in as a worker role, as deployed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_whose_job_was_deleted_by_hand_runs_again() {
    let db = support::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    let actor = idemstage_persistence::ops::Actor::parse("test").unwrap();
    let scope = idemstage_persistence::queue::Scope::Queue;
    idemstage_persistence::queue::pause(&mut conn, "extract", &scope, &actor)
        .await
        .unwrap();
    support::send(&mut conn, &tenant, item, &support::text(2)).await;
    let pool = idemstage_persistence::connect_pool(
        &db.worker_url(),
        idemstage_persistence::PoolConfig::default().with_max_size(12),
    )
    .await
    .unwrap();
    let config = PipelineWorkerConfig::default()
        .with_concurrency(2)
        .with_queue(fast_queue());
    assert_eq!(
        config.reconcile_interval,
        Some(Duration::from_secs(30)),
        "the default"
    );
    let w = worker(pool, &db.worker_url(), config);
    wait_count(
        &mut conn,
        "SELECT 1 FROM job_states WHERE queue = 'extract' AND state = 'created'",
        1,
        30,
    )
    .await;
    let deleted = tokio::time::Instant::now();
    let n = diesel::sql_query("DELETE FROM jobs WHERE queue = 'extract'")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 1);
    idemstage_persistence::queue::resume(&mut conn, "extract", &scope, &actor)
        .await
        .unwrap();
    wait_count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'extract' AND status = 'success'",
        1,
        75,
    )
    .await;
    let ran_after = deleted.elapsed();
    println!("extract ran again {ran_after:?} after its job was deleted (reconcile interval 30 s)");
    assert!(ran_after <= Duration::from_secs(45), "{ran_after:?}");
    let check = support::assert_quiet_and_sound(db.url(), 60).await;
    assert_eq!(check.stages_succeeded, 4, "{check:?}");
    w.0.cancel();
    w.1.await.unwrap();
}

/// A pipeline opens items faster than one batch an interval settles (the
/// two-hour soak: 50 items/s, 1,000 items every 30 s per worker, and
/// `items_open` held a third of all items after 13 minutes, growing): an
/// interval's reconciling goes on, batch after batch, to the last open item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interval_looks_at_every_open_item_whatever_the_batch() {
    let db = support::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    let items = 20;
    for i in 0..items {
        support::send(&mut conn, &tenant, ItemId::new(), &support::text(i)).await;
    }
    // No reconciler while the items run: every item final, every one still open.
    let w = worker(
        db.pool(12).await,
        db.url(),
        PipelineWorkerConfig::default()
            .with_concurrency(2)
            .with_queue(fast_queue())
            .with_reconcile_interval(None),
    );
    let check = support::wait_until(db.url(), "every item final", 60, |c| c.is_quiet()).await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    w.0.cancel();
    w.1.await.unwrap();
    assert_eq!(open_items(&mut conn).await, items as i64);

    // Two items a batch, an interval of 2 s: one batch an interval would take
    // 20 s; the first interval settles them all.
    let w = worker(
        db.pool(12).await,
        db.url(),
        PipelineWorkerConfig::default()
            .with_concurrency(2)
            .with_queue(fast_queue())
            .with_reconcile_interval(Some(Duration::from_secs(2)))
            .with_reconcile_batch_limit(2),
    );
    wait_count(&mut conn, "SELECT 1 FROM items_open", 0, 8).await;
    w.0.cancel();
    w.1.await.unwrap();
    support::assert_quiet_and_sound(db.url(), 30).await;
}

/// Final stages are never sent again: a stage that ended `dead` (only the
/// operator's retry revives it), and the stage after a success that stopped the
/// item (infeasible: `StageFlow::Stop`). The reconciler settles both
/// items, and nothing runs that did not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_stages_and_stages_after_a_stop_are_not_sent_again() {
    let db = support::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    // Infeasible: a unit nobody prices.
    let stopped = ItemId::new();
    support::send(&mut conn, &tenant, stopped, "3 Fass Bier").await;
    let w = worker(
        db.pool(12).await,
        db.url(),
        PipelineWorkerConfig::default()
            .with_concurrency(2)
            .with_queue(fast_queue())
            .with_reconcile_interval(Some(Duration::from_millis(200))),
    );
    let check = support::wait_until(db.url(), "the infeasible item final", 60, |c| {
        c.is_quiet() && c.infeasible == 1
    })
    .await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    wait_count(&mut conn, "SELECT 1 FROM items_open", 0, 30).await;
    w.0.cancel();
    w.1.await.unwrap();

    // Every body crashes: intake ends dead.
    let dead = ItemId::new();
    support::send(&mut conn, &tenant, dead, &support::text(3)).await;
    let mut options = idemstage_stage::Pipeline::default_send_options();
    options.expire_in = Duration::from_millis(support::JOB_LEASE_MS);
    let crashing = idemstage_example::pipeline(idemstage_example::Chaos::crashing(1.0))
        .with_send_options(options)
        .unwrap();
    let worker = PipelineWorker::new(
        db.pool(12).await,
        db.url(),
        crashing,
        PipelineWorkerConfig::default()
            .with_concurrency(2)
            .with_queue(fast_queue())
            .with_reconcile_interval(Some(Duration::from_millis(200))),
        Arc::new(Counters::default()),
    )
    .unwrap();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(worker.run(stop.clone()));
    wait_count(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'intake' AND status = 'dead'",
        1,
        60,
    )
    .await;
    wait_count(&mut conn, "SELECT 1 FROM items_open", 0, 30).await;
    stop.cancel();
    handle.await.unwrap();

    let check = support::assert_quiet_and_sound(db.url(), 30).await;
    assert_eq!(check.stages_succeeded, 3, "{check:?}");
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'calculate'"
        )
        .await,
        0,
        "calculate ran after feasibility stopped the item"
    );
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM jobs WHERE queue = 'calculate'").await,
        0
    );
    // Its attempts were all spent before the reconciler looked; none since.
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM stage_runs WHERE stage = 'intake' AND status = 'dead' AND attempts = max_attempts"
        )
        .await,
        1
    );
}
