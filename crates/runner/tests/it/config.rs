//! Settings that only work together are checked by the library, not by a CLI.

use std::sync::Arc;
use std::time::Duration;

use idemstage_runner::{Counters, PipelineWorker, PipelineWorkerConfig, WorkerError};

/// A dead worker's jobs come back only through maintenance: maintenance that runs
/// less often than the job lease lasts is refused (it used to be the CLI's rule).
#[tokio::test]
async fn maintenance_slower_than_the_job_lease_is_refused() {
    let db = idemstage_harness::example::db().await;
    // The pipeline's jobs have a 3 s lease; maintenance every 30 s by default.
    let pipeline = crate::support::pipeline();
    let config = PipelineWorkerConfig::default();
    assert_eq!(config.queue.maintenance_interval, Duration::from_secs(30));
    let err = PipelineWorker::new(
        db.pool(2).await,
        db.url(),
        pipeline.clone(),
        config.clone(),
        Arc::new(Counters::default()),
    )
    .err()
    .expect("a 30 s maintenance interval against a 3 s job lease was accepted");
    assert!(
        matches!(&err, WorkerError::Config(m) if m.contains("maintenance_interval")),
        "{err}"
    );
    let mut fitting = config;
    fitting.queue.maintenance_interval = Duration::from_secs(1);
    assert!(PipelineWorker::new(
        db.pool(2).await,
        db.url(),
        pipeline,
        fitting,
        Arc::new(Counters::default()),
    )
    .is_ok());
    // The pool a config needs: an execution's connection and its heartbeat's per
    // slot, plus the loop's and the completer's.
    let four = PipelineWorkerConfig::default().with_concurrency(4);
    assert_eq!(four.pool_size(), 11);
}

/// A worker may hold at most `MAX_HELD_JOBS` (running and fetched ahead): a larger
/// prefetch is refused, naming the setting.
#[tokio::test]
async fn a_prefetch_beyond_what_a_worker_may_hold_is_refused() {
    use idemstage_runner::queue_worker::MAX_HELD_JOBS;
    use idemstage_runner::{handler_fn, HandlerError, QueueWorker, QueueWorkerConfig};
    let db = idemstage_testkit::TestDb::new().await;
    let handler = || handler_fn(|_job, _: serde_json::Value| async { Ok::<(), HandlerError>(()) });
    let config = QueueWorkerConfig::for_queues(["q"])
        .with_concurrency(16)
        .with_prefetch(MAX_HELD_JOBS - 16 + 1);
    let err = QueueWorker::new(db.pool(2).await, db.url(), config.clone(), handler())
        .err()
        .expect("a prefetch beyond MAX_HELD_JOBS was accepted");
    assert!(
        matches!(&err, WorkerError::Config(m) if m.contains("prefetch")),
        "{err}"
    );
    assert!(config.validate().is_err());
    let fitting = config.with_prefetch(MAX_HELD_JOBS - 16);
    assert!(fitting.validate().is_ok());
    assert!(QueueWorker::new(db.pool(2).await, db.url(), fitting, handler()).is_ok());
}
