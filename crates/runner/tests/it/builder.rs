//! `PipelineWorker::builder`: the pool checked against the concurrency (or built
//! to fit), the counters optional.

use std::time::Duration;

use idemstage_domain::{ItemId, TenantId};
use idemstage_runner::{PipelineWorker, QueueWorkerConfig, WorkerBuildError};
use tokio_util::sync::CancellationToken;

use crate::support;

fn fast_queue() -> QueueWorkerConfig {
    QueueWorkerConfig::default()
        .with_poll_interval(Duration::from_millis(200))
        .with_maintenance_interval(Duration::from_millis(1000))
}

/// 4 executions need 2 × 4 + 3 = 11 connections: a pool of 5 is refused, and the
/// error says the numbers.
#[tokio::test]
async fn a_pool_smaller_than_the_concurrency_needs_is_refused_with_the_numbers() {
    let db = support::db().await;
    let err = PipelineWorker::builder(db.url(), support::pipeline())
        .concurrency(4)
        .queue(fast_queue())
        .pool(db.pool(5).await)
        .build()
        .await
        .err()
        .expect("a pool of 5 for 4 executions was accepted");
    assert!(
        matches!(
            err,
            WorkerBuildError::PoolTooSmall {
                pool_size: 5,
                needed: 11,
                concurrency: 4,
                fixed: 3
            }
        ),
        "{err:?}"
    );
    let text = err.to_string();
    for number in ["at most 5 connections", "4 stage executions", "needs 11"] {
        assert!(text.contains(number), "{text}");
    }
    // A pool of exactly the size needed is taken.
    PipelineWorker::builder(db.url(), support::pipeline())
        .concurrency(4)
        .queue(fast_queue())
        .pool(db.pool(11).await)
        .build()
        .await
        .unwrap();
    // Settings that do not work together are refused as by `new`, before any
    // pool is made (maintenance every 30 s against the example's 3 s lease).
    let err = PipelineWorker::builder("postgres://nowhere.invalid/x", support::pipeline())
        .build()
        .await
        .err()
        .expect("a 30 s maintenance interval against a 3 s job lease was accepted");
    assert!(
        matches!(&err, WorkerBuildError::Config(e) if e.to_string().contains("maintenance_interval")),
        "{err:?}"
    );
}

/// Without a pool or counters: the builder makes a pool of the right size and
/// the worker its own counters, and the worker drains the pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_built_worker_without_pool_or_counters_drains_a_pipeline() {
    let db = support::db().await;
    let mut conn = db.conn().await;
    let tenant = TenantId::parse("t1").unwrap();
    for i in 0..3 {
        support::send(&mut conn, &tenant, ItemId::new(), &support::text(i)).await;
    }
    let worker = PipelineWorker::builder(db.url(), support::pipeline())
        .concurrency(3)
        .queue(fast_queue())
        .build()
        .await
        .unwrap();
    let counters = worker.counters().clone();
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));

    let check = support::assert_quiet_and_sound(db.url(), 60).await;
    assert_eq!(check.items_final, 3, "{check:?}");
    assert_eq!(counters.snapshot().succeeded, 12, "4 stages × 3 items");
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("worker did not stop")
        .unwrap();
}
