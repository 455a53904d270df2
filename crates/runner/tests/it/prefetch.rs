//! A worker that fetches ahead (`prefetch`): it never holds more than
//! `concurrency + prefetch` jobs, a job whose lease was lost while it waited is not
//! started, and at shutdown the jobs it never started are given back at once.

use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;
use idemstage_domain::{JobId, JobRetryOutcome, SendOptions};
use idemstage_persistence::queue;
use idemstage_runner::{handler_fn, JobHandler, QueueWorkerConfig};
use idemstage_testkit::{count, TestDb};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::queue_worker::{config, job, row, send, start, wait_for_state, DEADLINE};

/// A handler that has started and waits to be let go.
pub(crate) struct Started {
    pub(crate) id: JobId,
    pub(crate) attempt: i32,
    /// Send to let the handler return `Ok`; drop to keep it waiting for good
    /// (until the worker aborts it).
    pub(crate) release: oneshot::Sender<()>,
}

/// Reports each job it starts, then waits until the test lets it go.
pub(crate) fn held_handler(
    started: mpsc::UnboundedSender<Started>,
) -> impl JobHandler<Payload = serde_json::Value> {
    handler_fn(
        move |job: idemstage_domain::FetchedJob, _p: serde_json::Value| {
            let started = started.clone();
            async move {
                let (release, released) = oneshot::channel();
                started
                    .send(Started {
                        id: job.id,
                        attempt: job.attempt,
                        release,
                    })
                    .unwrap();
                if released.await.is_err() {
                    std::future::pending::<()>().await;
                }
                Ok(())
            }
        },
    )
}

pub(crate) async fn next_started(rx: &mut mpsc::UnboundedReceiver<Started>) -> Started {
    tokio::time::timeout(DEADLINE, rx.recv())
        .await
        .expect("no handler started")
        .expect("handler channel closed")
}

async fn active(conn: &mut AsyncPgConnection, queue: &str) -> i64 {
    count(
        conn,
        &format!("SELECT 1 FROM job_states WHERE queue = '{queue}' AND state = 'active'"),
    )
    .await
}

/// Polls until `active` jobs of `queue` are `want`, asserting at every look that
/// they are never more than `most` (the sleep only paces the polling).
async fn wait_active(conn: &mut AsyncPgConnection, queue: &str, want: i64, most: i64) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let n = active(conn, queue).await;
        assert!(n <= most, "{n} jobs active, more than the {most} allowed");
        if n == want {
            return;
        }
        assert!(Instant::now() < deadline, "{n} jobs active, never {want}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn prefetching(queue: &str, concurrency: usize, prefetch: usize) -> QueueWorkerConfig {
    config(queue)
        .with_concurrency(concurrency)
        .with_prefetch(prefetch)
        // Larger than the room, so that only the limit bounds a fetch.
        .with_batch_size(100)
}

/// 20 jobs through 2 handlers fetching 3 ahead: after each job, with its
/// completion written, at most 5 jobs are leased, and at first exactly 5 are (the
/// buffer is filled). Handlers are let go one at a time, in the order they start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetching_worker_never_holds_more_than_concurrency_plus_prefetch() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(
            send(
                &mut conn,
                job("pf", json!({ "i": i }), SendOptions::default()),
            )
            .await,
        );
    }
    let (tx, mut started) = mpsc::unbounded_channel();
    let w = start(
        db.pool(6).await,
        db.url(),
        prefetching("pf", 2, 3),
        held_handler(tx),
    );
    // Two handlers running, three jobs waiting in the worker.
    let mut running = vec![
        next_started(&mut started).await,
        next_started(&mut started).await,
    ];
    wait_active(&mut conn, "pf", 5, 5).await;
    let mut starts = running.len();
    for done in 1..=20 {
        let first = running.remove(0);
        let id = first.id;
        first.release.send(()).unwrap();
        wait_for_state(&mut conn, id, "completed").await;
        // Its slot goes to a waiting job; the worker fetches when its buffer is
        // down to one. With this completion written and no other handler let go,
        // every leased job is running or waiting: never more than 5.
        if starts < 20 {
            running.push(next_started(&mut started).await);
            starts += 1;
        }
        let n = active(&mut conn, "pf").await;
        assert!(n <= 5, "{n} jobs active after {done} completions");
    }
    let stats = w.shutdown().await;
    assert_eq!(
        (stats.fetched, stats.completed, stats.released),
        (20, 20, 0)
    );
    for id in ids {
        assert_eq!(row(&mut conn, id).await.state, "completed");
    }
}

/// At shutdown the jobs fetched ahead are given back at once, while a handler is
/// still running (within its grace): another worker can take them straight away,
/// not after their 15-minute lease; none is counted as a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_back_prefetched_jobs_at_once_while_handlers_finish() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for i in 0..5 {
        send(
            &mut conn,
            job("sd", json!({ "i": i }), SendOptions::default()),
        )
        .await;
    }
    let (tx, mut started) = mpsc::unbounded_channel();
    let w = start(
        db.pool(6).await,
        db.url(),
        prefetching("sd", 1, 4),
        held_handler(tx),
    );
    let running = next_started(&mut started).await;
    wait_active(&mut conn, "sd", 5, 5).await;

    w.stop.cancel();
    // Given back while the handler still runs: the four are fetchable now.
    let deadline = Instant::now() + DEADLINE;
    while count(
        &mut conn,
        "SELECT 1 FROM job_states WHERE queue = 'sd' AND state = 'retry'
            AND retry_count = 0 AND start_after <= now() AND lease_expires_at IS NULL",
    )
    .await
        < 4
    {
        assert!(
            Instant::now() < deadline,
            "the prefetched jobs were not given back"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        !w.handle.is_finished(),
        "the worker did not wait for its handler"
    );
    assert_eq!(row(&mut conn, running.id).await.state, "active");
    let other = queue::fetch(&mut conn, &["sd".to_owned()], 10)
        .await
        .unwrap();
    assert_eq!(other.len(), 4);
    assert!(other.iter().all(|j| j.attempt == 2 && j.id != running.id));

    running.release.send(()).unwrap();
    let stats = w.shutdown().await;
    assert_eq!(
        (
            stats.fetched,
            stats.completed,
            stats.released,
            stats.failed,
            stats.fenced
        ),
        (5, 1, 4, 0, 0)
    );
    assert_eq!(row(&mut conn, running.id).await.state, "completed");
}

/// A job taken over while it waited in the worker (its lease found lost at the
/// next renewal) is not started, and counted as fenced; its new holder's lease is
/// left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetched_job_whose_lease_was_lost_is_not_started() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // A short lease, so that the worker renews (and finds the loss) soon; no
    // maintenance, so that only the test takes the job over.
    let short = SendOptions::default().with_expire_in(Duration::from_millis(300));
    let a = send(&mut conn, job("lost", json!({ "i": 0 }), short.clone())).await;
    let b = send(&mut conn, job("lost", json!({ "i": 1 }), short)).await;
    let (tx, mut started) = mpsc::unbounded_channel();
    let cfg = prefetching("lost", 1, 1).with_maintenance_interval(Duration::from_secs(3600));
    let w = start(db.pool(6).await, db.url(), cfg, held_handler(tx));
    let running = next_started(&mut started).await;
    assert_eq!(running.id, a);
    wait_active(&mut conn, "lost", 2, 2).await;

    // Another worker takes b over: given back and fetched again, a new token.
    assert_eq!(
        queue::retry_now(&mut conn, b, 1).await.unwrap(),
        JobRetryOutcome::Requeued
    );
    let taken = queue::fetch(&mut conn, &["lost".to_owned()], 1)
        .await
        .unwrap();
    assert_eq!((taken[0].id, taken[0].attempt), (b, 2));
    // The worker's next renewal of b is refused, and the worker counts the loss
    // once b's holder knows it (a lease moved in the database says only that the
    // statement ran, not that the worker has read its answer).
    let deadline = Instant::now() + DEADLINE;
    while w.stats.snapshot().leases_lost == 0 {
        assert!(Instant::now() < deadline, "the loss of b was never found");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    running.release.send(()).unwrap();
    wait_for_state(&mut conn, a, "completed").await;
    let stats = w.shutdown().await;
    assert_eq!(
        (
            stats.completed,
            stats.fenced,
            stats.released,
            stats.leases_lost
        ),
        (1, 1, 0, 1),
        "{stats:?}"
    );
    // b's handler never ran here, and b is still its new holder's.
    assert!(started.try_recv().is_err(), "the lost job was started");
    assert_eq!(row(&mut conn, b).await.state, "active");
    assert_eq!(
        queue::complete(&mut conn, b, 2, None).await.unwrap(),
        idemstage_domain::JobCompleteOutcome::Completed
    );
}
