//! A worker on a rate-limited or capped queue: the fetch holds ready jobs back, and
//! no notification comes when the bucket refills or a slot frees, so the worker
//! must fetch again when the control lets more through, not at its poll interval.

use std::time::{Duration, Instant};

use idemstage_domain::SendOptions;
use idemstage_persistence::queue::{self, Limits, Rate, Scope};
use idemstage_runner::{handler_fn, HandlerError};
use idemstage_testkit::{count, TestDb};
use serde_json::json;

use crate::queue_worker::{config, job, start, DEADLINE};

/// 40 jobs at 20 per second (burst 5) with a poll interval of 10 minutes: the
/// burst, then a fetch per refill. Waiting for the poll, the worker would finish
/// 5 jobs within the deadline.
#[tokio::test]
async fn a_rate_limited_backlog_drains_at_the_rate_not_at_the_poll_interval() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let jobs: Vec<_> = (0..40)
        .map(|i| job("limited", json!({ "i": i }), SendOptions::default()))
        .collect();
    queue::send_batch(&mut conn, &jobs).await.unwrap();
    let rate = Limits {
        rate: Some(Rate {
            count: 20,
            per: Duration::from_secs(1),
            burst: Some(5),
        }),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "limited", &Scope::Queue, &rate, &test_actor())
        .await
        .unwrap();
    let mut cfg = config("limited");
    cfg.poll_interval = Duration::from_secs(600);
    cfg.concurrency = 4;
    cfg.batch_size = 4;
    let handler = handler_fn(|_job, _: serde_json::Value| async { Ok::<(), HandlerError>(()) });
    let running = start(db.pool(8).await, db.url(), cfg, handler);

    let started = Instant::now();
    let done = "SELECT 1 FROM job_states WHERE queue = 'limited' AND state = 'completed'";
    while count(&mut conn, done).await < 40 {
        assert!(
            started.elapsed() < DEADLINE,
            "{} of 40 jobs completed: the worker waited for its poll interval",
            count(&mut conn, done).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.shutdown().await;
}

/// Who these tests' control changes are recorded as made by.
fn test_actor() -> idemstage_persistence::ops::Actor {
    idemstage_persistence::ops::Actor::parse("test").unwrap()
}
