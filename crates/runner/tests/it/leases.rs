//! The worker's leases and completions in batches: one lease keeper renews every
//! held job together, and a completion whose lease was taken over is refused by
//! its fence, reported as fenced, while the rest of the batch completes.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{JobCompleteOutcome, JobRetryOutcome, SendOptions};
use idemstage_persistence::queue;
use idemstage_testkit::TestDb;
use serde_json::json;
use tokio::sync::mpsc;

use crate::prefetch::{held_handler, next_started};
use crate::queue_worker::{config, job, row, send, start, wait_for_state, DEADLINE};

/// Three handlers finish; one job was taken over by another worker meanwhile. The
/// batched completer completes the other two, and for that one reports the lost
/// fence (`fenced`) and leaves it to its new holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_completion_whose_lease_was_taken_over_is_fenced_and_not_completed() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for i in 0..3 {
        send(
            &mut conn,
            job("tk", json!({ "i": i }), SendOptions::default()),
        )
        .await;
    }
    let (tx, mut started) = mpsc::unbounded_channel();
    let cfg = config("tk").with_concurrency(3).with_batch_size(3);
    let w = start(db.pool(6).await, db.url(), cfg, held_handler(tx));
    let mut handlers = Vec::new();
    for _ in 0..3 {
        handlers.push(next_started(&mut started).await);
    }
    let victim = (handlers[0].id, handlers[0].attempt);
    // Taken over: given back and fetched by someone else, under a new token. The
    // worker holds its 3 jobs, so it has no room to fetch it again itself.
    assert_eq!(
        queue::retry_now(&mut conn, victim.0, victim.1)
            .await
            .unwrap(),
        JobRetryOutcome::Requeued
    );
    let taken = queue::fetch(&mut conn, &["tk".to_owned()], 1)
        .await
        .unwrap();
    assert_eq!((taken[0].id, taken[0].attempt), (victim.0, victim.1 + 1));

    let others: Vec<_> = handlers[1..].iter().map(|h| h.id).collect();
    for h in handlers {
        h.release.send(()).unwrap();
    }
    for id in &others {
        wait_for_state(&mut conn, *id, "completed").await;
    }
    let stats = w.shutdown().await;
    assert_eq!((stats.completed, stats.fenced), (2, 1), "{stats:?}");
    // Not completed by the stale token: still active under the new one, which
    // still completes it.
    assert_eq!(row(&mut conn, victim.0).await.state, "active");
    assert_eq!(
        queue::complete(&mut conn, victim.0, victim.1 + 1, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
}

#[derive(diesel::QueryableByName, Debug)]
struct Leases {
    #[diesel(sql_type = BigInt)]
    active: i64,
    #[diesel(sql_type = BigInt)]
    distinct_leases: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    earliest: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Integer>)]
    max_attempt: Option<i32>,
}

async fn leases(conn: &mut AsyncPgConnection, queue: &str) -> Leases {
    diesel::sql_query(
        "SELECT count(*) AS active, count(DISTINCT lease_expires_at) AS distinct_leases,
                min(lease_expires_at) AS earliest, max(attempt) AS max_attempt
           FROM job_states WHERE queue = $1 AND state = 'active'",
    )
    .bind::<Text, _>(queue)
    .get_result(conn)
    .await
    .unwrap()
}

/// Four jobs with a 300 ms lease, two running and two waiting in the worker, held
/// for several lease lengths while maintenance runs every 200 ms: their leases are
/// renewed, all four by the same statements (one lease end between them), so none
/// is taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leases_of_held_jobs_are_renewed_together_running_or_waiting() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let short = SendOptions::default().with_expire_in(Duration::from_millis(300));
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(send(&mut conn, job("rn", json!({ "i": i }), short.clone())).await);
    }
    let (tx, mut started) = mpsc::unbounded_channel();
    let cfg = config("rn")
        .with_concurrency(2)
        .with_prefetch(2)
        .with_batch_size(4);
    let w = start(db.pool(6).await, db.url(), cfg, held_handler(tx));
    let first = next_started(&mut started).await;
    let second = next_started(&mut started).await;
    let fetched_lease = leases(&mut conn, "rn").await;
    assert_eq!(
        (fetched_lease.active, fetched_lease.distinct_leases),
        (4, 1)
    );
    let fetched_until = fetched_lease.earliest.unwrap();

    // Until the leases reach three lease lengths past the fetch's: at least eight
    // renewals each, every time all four in one statement.
    let deadline = Instant::now() + DEADLINE;
    loop {
        let l = leases(&mut conn, "rn").await;
        assert_eq!(
            (l.active, l.max_attempt),
            (4, Some(1)),
            "a job was taken over: {l:?}"
        );
        assert_eq!(l.distinct_leases, 1, "renewed apart: {l:?}");
        if l.earliest.unwrap() > fetched_until + Duration::from_millis(900) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the leases were not renewed: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    first.release.send(()).unwrap();
    second.release.send(()).unwrap();
    for _ in 0..2 {
        next_started(&mut started).await.release.send(()).unwrap();
    }
    for id in ids {
        wait_for_state(&mut conn, id, "completed").await;
    }
    let stats = w.shutdown().await;
    assert_eq!(
        (stats.completed, stats.fenced, stats.failed),
        (4, 0, 0),
        "{stats:?}"
    );
}
