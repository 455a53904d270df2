//! The built-in example pipeline (`idemstage-example`) in tests: sending items as `idemstage enqueue` does, in-process stage workers,
//! and waiting on the database with the example's checker (polling with a
//! deadline; never a sleep as synchronisation).

use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use idemstage::items::register_item;
use idemstage::pipeline::first_job;
use idemstage::runs::TxError;
use idemstage::{ids::ItemId, ids::TenantId, queue::SendResult};
use idemstage_example::{check_example_pipeline, Chaos, PipelineCheck};

/// A fresh database with the core's and the example pipeline's migrations (from a
/// template made once per server and migration fingerprint).
pub async fn db() -> idemstage_testkit::TestDb {
    idemstage_testkit::TestDb::with_template(
        vec![idemstage_example::MIGRATIONS],
        idemstage_example::MIGRATIONS_FINGERPRINT,
    )
    .await
}

/// The job lease of the example pipeline's jobs (short, so that a killed
/// worker's jobs come back within seconds).
pub const JOB_LEASE_MS: u64 = 3000;

/// The example pipeline with a job lease of `JOB_LEASE_MS`.
pub fn pipeline() -> idemstage::pipeline::Pipeline {
    let mut options = idemstage::pipeline::Pipeline::default_send_options();
    options.expire_in = Duration::from_millis(JOB_LEASE_MS);
    idemstage_example::pipeline(Chaos::default())
        .with_send_options(options)
        .unwrap()
}

/// A feasible text (every position has a quantity and a known unit).
pub fn text(i: usize) -> String {
    format!("{} Stk Schrauben\n{} m Kabel", i + 1, i % 7 + 1)
}

/// Registers an item (if new) and sends its intake job in one transaction, as
/// `idemstage enqueue` does.
pub async fn send(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: ItemId,
    text: &str,
) -> SendResult {
    let pipeline = pipeline();
    let job = first_job(
        &pipeline,
        tenant.clone(),
        item,
        idemstage::ids::input_hash_of(text.as_bytes()),
    );
    conn.transaction::<_, TxError, _>(async |conn| {
        register_item(conn, tenant, &item, text).await?;
        Ok(idemstage::queue::send_in(conn, &job).await?)
    })
    .await
    .unwrap()
}

/// Polls the checker until `done` holds; panics with the last check at the deadline.
pub async fn wait_until(
    url: &str,
    what: &str,
    secs: u64,
    mut done: impl FnMut(&PipelineCheck) -> bool,
) -> PipelineCheck {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    let mut conn = None;
    loop {
        // Reconnect if the server went away.
        if conn.is_none() {
            conn = idemstage::db::connect(url).await.ok();
        }
        if let Some(c) = conn.as_mut() {
            match check_example_pipeline(c).await {
                Ok(check) if done(&check) => return check,
                Ok(check) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "timed out waiting for {what}: {check:?}"
                ),
                Err(_) => conn = None,
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what} (database unreachable)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until every item is final and no job is live, then checks every
/// invariant and returns the check.
pub async fn assert_quiet_and_sound(url: &str, secs: u64) -> PipelineCheck {
    let check = wait_until(url, "every item final, no live job", secs, |c| c.is_quiet()).await;
    assert_eq!(check.violations(), Vec::<String>::new(), "{check:?}");
    check
}

/// An in-process stage worker over `pipeline`, polling and maintaining often.
pub fn start_pipeline_worker(
    pool: idemstage::db::PgPool,
    url: &str,
    pipeline: idemstage::pipeline::Pipeline,
    concurrency: usize,
    counters: std::sync::Arc<idemstage::worker::Counters>,
) -> (
    idemstage::worker::CancellationToken,
    tokio::task::JoinHandle<idemstage::worker::WorkerStatsSnapshot>,
) {
    let config = idemstage::worker::PipelineWorkerConfig::default()
        .with_concurrency(concurrency)
        .with_queue(
            idemstage::worker::QueueWorkerConfig::default()
                .with_poll_interval(Duration::from_millis(200))
                .with_maintenance_interval(Duration::from_millis(1000))
                .with_error_backoff(Duration::from_millis(20), Duration::from_millis(500)),
        );
    let worker =
        idemstage::worker::PipelineWorker::new(pool, url, pipeline, config, counters).unwrap();
    let stop = idemstage::worker::CancellationToken::new();
    let handle = tokio::spawn(worker.run(stop.clone()));
    (stop, handle)
}

/// Stops an in-process worker started by `start_pipeline_worker`.
pub async fn stop_pipeline_worker(
    (stop, handle): (
        idemstage::worker::CancellationToken,
        tokio::task::JoinHandle<idemstage::worker::WorkerStatsSnapshot>,
    ),
) -> idemstage::worker::WorkerStatsSnapshot {
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("worker did not stop")
        .expect("worker task panicked")
}
