//! Layer 2, the job queue, against a real PostgreSQL: singleton keys under
//! concurrency, transactional send, exactly-once fetch, fencing, retries, backoff,
//! dead letters, maintenance.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Bool, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures_util::StreamExt;
use idemstage_domain::{
    FailKind, FetchedJob, JobCancelOutcome, JobCompleteOutcome, JobFailOutcome, JobId,
    JobRetryOutcome, JobToSend, RepoError, SendOptions, SendResult,
};
use idemstage_persistence::queue::{
    self, MaintenanceConfig, MaintenanceOutcome, RenewLeaseOutcome,
};
use idemstage_testkit::TestDb;
use serde_json::json;
use tokio::sync::Barrier;

fn job(queue: &str, payload: serde_json::Value, options: SendOptions) -> JobToSend {
    JobToSend {
        tenant: None,
        queue: queue.to_owned(),
        payload,
        options,
    }
}

fn keyed(key: &str) -> SendOptions {
    SendOptions::default().with_singleton_key(key)
}

fn sent(r: SendResult) -> JobId {
    match r {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("expected Sent, got Duplicate"),
    }
}

#[derive(diesel::QueryableByName, Debug)]
struct JobRow {
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Integer)]
    retry_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    completed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Text)]
    payload: String,
}

async fn row(conn: &mut AsyncPgConnection, id: JobId) -> JobRow {
    diesel::sql_query(
        "SELECT queue, state, attempt, retry_count, last_error, completed_at, payload::text
           FROM job_states WHERE id = $1",
    )
    .bind::<Text, _>(id.to_string())
    .get_result(conn)
    .await
    .unwrap_or_else(|e| panic!("job {id}: {e}"))
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn count(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    let c: Count = diesel::sql_query(sql).get_result(conn).await.unwrap();
    c.n
}

async fn fetch_one(conn: &mut AsyncPgConnection, queue: &str) -> FetchedJob {
    let mut jobs = queue::fetch(conn, &[queue.to_owned()], 1).await.unwrap();
    assert_eq!(jobs.len(), 1, "expected one fetchable job in {queue}");
    jobs.pop().unwrap()
}

/// Makes a job due now (the tests check computed delays, they do not wait them out).
async fn make_due(conn: &mut AsyncPgConnection, id: JobId) {
    diesel::sql_query("UPDATE jobs SET start_after = now() WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .execute(conn)
        .await
        .unwrap();
}

/// Waits until the job's lease has run out by the database clock. The sleep only
/// paces the polling; the condition is the database's.
async fn wait_until_lease_expired(conn: &mut AsyncPgConnection, id: JobId) {
    #[derive(diesel::QueryableByName)]
    struct Expired {
        #[diesel(sql_type = Bool)]
        expired: bool,
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let e: Expired = diesel::sql_query(
            "SELECT lease_expires_at < now() AS expired FROM job_states WHERE id = $1",
        )
        .bind::<Text, _>(id.to_string())
        .get_result(conn)
        .await
        .unwrap();
        if e.expired {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "lease of {id} never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_senders_of_one_key_give_one_sent_then_key_is_free_after_complete() {
    let db = TestDb::new().await;
    const SENDERS: usize = 32;
    let barrier = Arc::new(Barrier::new(SENDERS));
    let mut tasks = Vec::new();
    for i in 0..SENDERS {
        // Each sender has its own session, connected before the barrier.
        let mut conn = db.conn().await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            queue::send_in(
                &mut conn,
                &job("intake", json!({ "sender": i }), keyed("intake:t1:A")),
            )
            .await
            .unwrap()
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let sent_ids: Vec<JobId> = results
        .iter()
        .filter_map(|r| match r {
            SendResult::Sent(id) => Some(*id),
            SendResult::Duplicate => None,
        })
        .collect();
    assert_eq!(sent_ids.len(), 1, "{results:?}");
    assert_eq!(
        results
            .iter()
            .filter(|r| **r == SendResult::Duplicate)
            .count(),
        SENDERS - 1
    );
    let mut conn = db.conn().await;
    assert_eq!(count(&mut conn, "SELECT count(*) AS n FROM jobs").await, 1);

    // Active and retrying jobs hold the key as well.
    let again = || job("intake", json!({}), keyed("intake:t1:A"));
    let fetched = fetch_one(&mut conn, "intake").await;
    assert_eq!(fetched.id, sent_ids[0]);
    assert_eq!(
        queue::send_in(&mut conn, &again()).await.unwrap(),
        SendResult::Duplicate
    );
    let failed = queue::fail(
        &mut conn,
        fetched.id,
        fetched.attempt,
        "boom",
        FailKind::Transient,
    )
    .await
    .unwrap();
    assert!(
        matches!(failed, JobFailOutcome::Retrying { .. }),
        "{failed:?}"
    );
    assert_eq!(
        queue::send_in(&mut conn, &again()).await.unwrap(),
        SendResult::Duplicate
    );
    // Another queue is another key space.
    sent(
        queue::send_in(&mut conn, &job("other", json!({}), keyed("intake:t1:A")))
            .await
            .unwrap(),
    );

    // Once the job completes, the key can be sent again.
    let fetched = fetch_one(&mut conn, "intake").await;
    assert_eq!(
        queue::complete(&mut conn, fetched.id, fetched.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
    let new_id = sent(queue::send_in(&mut conn, &again()).await.unwrap());
    assert_ne!(new_id, fetched.id);
}

// The fields are read only through Debug, in unwrap panics.
#[allow(dead_code)]
#[derive(Debug)]
enum TxErr {
    Repo(RepoError),
    Diesel(diesel::result::Error),
    Rollback,
}
impl From<diesel::result::Error> for TxErr {
    fn from(e: diesel::result::Error) -> Self {
        TxErr::Diesel(e)
    }
}
impl From<RepoError> for TxErr {
    fn from(e: RepoError) -> Self {
        TxErr::Repo(e)
    }
}

#[tokio::test]
async fn a_send_in_a_rolled_back_transaction_never_exists_and_never_wakes_a_worker() {
    let db = TestDb::new().await;
    let mut listener = db.conn().await;
    listener
        .batch_execute("LISTEN idemstage_jobs")
        .await
        .unwrap();
    let mut conn = db.conn().await;

    let rolled_back = conn
        .transaction::<(), TxErr, _>(async |c| {
            let r = queue::send_in(c, &job("ghost", json!({}), keyed("k"))).await?;
            assert!(matches!(r, SendResult::Sent(_)));
            // Visible inside the transaction...
            assert_eq!(
                count(c, "SELECT count(*) AS n FROM jobs WHERE queue = 'ghost'").await,
                1
            );
            Err(TxErr::Rollback)
        })
        .await;
    assert!(
        matches!(rolled_back, Err(TxErr::Rollback)),
        "{rolled_back:?}"
    );
    // ...and gone after the rollback.
    assert_eq!(count(&mut conn, "SELECT count(*) AS n FROM jobs").await, 0);

    let marker = conn
        .transaction::<SendResult, TxErr, _>(async |c| {
            Ok(queue::send_in(c, &job("marker", json!({}), SendOptions::default())).await?)
        })
        .await
        .unwrap();
    sent(marker);

    let mut notifications = std::pin::pin!(listener.notifications_stream());
    // The timeout only turns a hang into a failure; the assertion is on the payload.
    let first = tokio::time::timeout(Duration::from_secs(30), notifications.next())
        .await
        .expect("no notification at all")
        .expect("stream ended")
        .expect("notification error");
    assert_eq!(first.channel, queue::NOTIFY_CHANNEL);
    assert_eq!(first.payload, "marker", "the rolled-back send notified");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_concurrent_fetchers_deliver_each_of_5000_jobs_exactly_once() {
    let db = TestDb::new().await;
    const JOBS: usize = 5000;
    const FETCHERS: usize = 8;
    let mut conn = db.conn().await;
    let all: Vec<JobToSend> = (0..JOBS)
        .map(|i| job("bulk", json!({ "i": i }), SendOptions::default()))
        .collect();
    for chunk in all.chunks(1000) {
        let results = queue::send_batch(&mut conn, chunk).await.unwrap();
        assert!(results.iter().all(|r| matches!(r, SendResult::Sent(_))));
    }

    let barrier = Arc::new(Barrier::new(FETCHERS));
    let mut tasks = Vec::new();
    for _ in 0..FETCHERS {
        let mut conn = db.conn().await;
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut mine = Vec::new();
            loop {
                let jobs = queue::fetch(&mut conn, &["bulk".to_owned()], 25)
                    .await
                    .unwrap();
                // Every job was created before the fetchers started and none fails,
                // so an empty fetch means the queue is drained.
                if jobs.is_empty() {
                    return mine;
                }
                let tokens: Vec<(JobId, i32)> = jobs.iter().map(|j| (j.id, j.attempt)).collect();
                let outcomes = queue::complete_many(&mut conn, &tokens).await.unwrap();
                assert!(outcomes.iter().all(|o| *o == JobCompleteOutcome::Completed));
                assert!(jobs.iter().all(|j| j.attempt == 1));
                mine.extend(jobs.into_iter().map(|j| j.id));
            }
        }));
    }
    let mut delivered = Vec::new();
    let mut busy_fetchers = 0;
    for t in tasks {
        let mine = t.await.unwrap();
        busy_fetchers += usize::from(!mine.is_empty());
        delivered.extend(mine);
    }
    assert_eq!(delivered.len(), JOBS);
    assert_eq!(delivered.iter().collect::<HashSet<_>>().len(), JOBS);
    assert!(busy_fetchers > 1, "only one fetcher got work");
    assert_eq!(
        count(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE state = 'completed'"
        )
        .await,
        JOBS as i64
    );
}

#[tokio::test]
async fn fetch_orders_by_priority_then_age_and_respects_start_after_and_queues() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let opts = |priority: i32| SendOptions::default().with_priority(priority);
    let low_old = sent(
        queue::send_in(&mut conn, &job("q", json!(1), opts(0)))
            .await
            .unwrap(),
    );
    let high = sent(
        queue::send_in(&mut conn, &job("q", json!(2), opts(5)))
            .await
            .unwrap(),
    );
    let low_new = sent(
        queue::send_in(&mut conn, &job("q", json!(3), opts(0)))
            .await
            .unwrap(),
    );
    let _later = sent(
        queue::send_in(
            &mut conn,
            &job(
                "q",
                json!(4),
                SendOptions::default()
                    .with_priority(9)
                    .with_start_after(Duration::from_secs(3600)),
            ),
        )
        .await
        .unwrap(),
    );
    let other = sent(
        queue::send_in(&mut conn, &job("other", json!(5), opts(99)))
            .await
            .unwrap(),
    );

    let jobs = queue::fetch(&mut conn, &["q".to_owned()], 10)
        .await
        .unwrap();
    let ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    assert_eq!(ids, vec![high, low_old, low_new]);
    let j = &jobs[0];
    assert_eq!((j.attempt, j.retry_count, j.priority), (1, 0, 5));
    assert_eq!(j.payload, json!(2));
    assert!(j.lease_expires_at > j.created_at);
    let r = row(&mut conn, high).await;
    assert_eq!((r.state.as_str(), r.attempt), ("active", 1));
    assert!(queue::fetch(&mut conn, &["q".to_owned()], 10)
        .await
        .unwrap()
        .is_empty());
    // Several queues in one fetch.
    let jobs = queue::fetch(&mut conn, &["q".to_owned(), "other".to_owned()], 10)
        .await
        .unwrap();
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![other]);

    // Across queues each queue gets its share (its best job first), and the limit is
    // global.
    let x1 = sent(
        queue::send_in(&mut conn, &job("x", json!(1), opts(1)))
            .await
            .unwrap(),
    );
    let _x0 = sent(
        queue::send_in(&mut conn, &job("x", json!(0), opts(0)))
            .await
            .unwrap(),
    );
    let y2 = sent(
        queue::send_in(&mut conn, &job("y", json!(2), opts(2)))
            .await
            .unwrap(),
    );
    let jobs = queue::fetch(&mut conn, &["x".to_owned(), "y".to_owned()], 2)
        .await
        .unwrap();
    let mut ids: Vec<JobId> = jobs.iter().map(|j| j.id).collect();
    ids.sort();
    let mut expected = vec![y2, x1];
    expected.sort();
    assert_eq!(ids, expected);
    assert_eq!(
        count(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE queue = 'x' AND state = 'created'"
        )
        .await,
        1
    );
}

#[tokio::test]
async fn an_expired_lease_is_retried_by_maintenance_and_the_stale_worker_is_fenced() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = sent(
        queue::send_in(
            &mut conn,
            &job(
                "lease",
                json!({}),
                keyed("lease-key")
                    .with_expire_in(Duration::from_millis(200))
                    .with_retry_limit(1),
            ),
        )
        .await
        .unwrap(),
    );
    let stale = fetch_one(&mut conn, "lease").await;
    assert_eq!(stale.expire_in, Duration::from_millis(200));
    // Before the lease runs out, maintenance leaves the job alone.
    let before = queue::maintain(&mut conn, &MaintenanceConfig::default())
        .await
        .unwrap();
    if let MaintenanceOutcome::Ran(r) = before {
        assert_eq!(r.expired_retried + r.expired_failed, 0, "{r:?}");
    }

    wait_until_lease_expired(&mut conn, id).await;
    let MaintenanceOutcome::Ran(report) = queue::maintain(&mut conn, &MaintenanceConfig::default())
        .await
        .unwrap()
    else {
        panic!("maintenance skipped without a concurrent maintainer");
    };
    assert_eq!((report.expired_retried, report.expired_failed), (1, 0));
    let r = row(&mut conn, id).await;
    assert_eq!((r.state.as_str(), r.retry_count), ("retry", 1));
    assert!(r.last_error.unwrap().contains("lease expired"));

    // The stale worker can neither complete, fail, cancel, release nor renew.
    assert_eq!(
        queue::complete(&mut conn, id, stale.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Fenced
    );
    assert_eq!(
        queue::renew_lease(&mut conn, id, stale.attempt)
            .await
            .unwrap(),
        RenewLeaseOutcome::Fenced
    );

    // A new worker gets it with a new token; the old token stays fenced.
    let fresh = fetch_one(&mut conn, "lease").await;
    assert_eq!((fresh.id, fresh.attempt, fresh.retry_count), (id, 2, 1));
    assert_eq!(
        queue::complete(&mut conn, id, stale.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Fenced
    );
    assert_eq!(
        queue::fail(&mut conn, id, stale.attempt, "x", FailKind::Transient)
            .await
            .unwrap(),
        JobFailOutcome::Fenced
    );
    assert_eq!(
        queue::cancel(&mut conn, id, stale.attempt).await.unwrap(),
        JobCancelOutcome::Fenced
    );
    assert_eq!(
        queue::retry_now(&mut conn, id, stale.attempt)
            .await
            .unwrap(),
        JobRetryOutcome::Fenced
    );
    assert!(matches!(
        queue::renew_lease(&mut conn, id, fresh.attempt)
            .await
            .unwrap(),
        RenewLeaseOutcome::Renewed { .. }
    ));

    // Expiring again with no retries left fails the job for good.
    wait_until_lease_expired(&mut conn, id).await;
    let MaintenanceOutcome::Ran(report) = queue::maintain(&mut conn, &MaintenanceConfig::default())
        .await
        .unwrap()
    else {
        panic!("maintenance skipped");
    };
    assert_eq!((report.expired_retried, report.expired_failed), (0, 1));
    assert_eq!(row(&mut conn, id).await.state, "failed");
    assert_eq!(
        queue::complete(&mut conn, id, fresh.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Fenced
    );
}

/// Fails the job and returns the outcome and `start_after - now()` in milliseconds,
/// with `now()` of the failing transaction (so the delay is exact, not approximate).
async fn fail_measured(conn: &mut AsyncPgConnection, j: &FetchedJob) -> (JobFailOutcome, i64) {
    #[derive(diesel::QueryableByName)]
    struct Now {
        #[diesel(sql_type = Timestamptz)]
        now: DateTime<Utc>,
    }
    let (id, attempt) = (j.id, j.attempt);
    conn.transaction::<_, TxErr, _>(async move |c| {
        let outcome = queue::fail(c, id, attempt, "handler error", FailKind::Transient).await?;
        let now: Now = diesel::sql_query("SELECT now() AS now")
            .get_result(c)
            .await?;
        let delay = match outcome {
            JobFailOutcome::Retrying { start_after } => (start_after - now.now).num_milliseconds(),
            _ => -1,
        };
        Ok((outcome, delay))
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn fixed_retry_delay_then_failed_after_the_limit_with_a_dead_letter_copy() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = sent(
        queue::send_in(
            &mut conn,
            &job(
                "work",
                json!({ "tenant": "t1" }),
                keyed("work:t1:A")
                    .with_retry_limit(2)
                    .with_retry_delay(Duration::from_millis(1500))
                    .with_dead_letter("work-dead".to_owned())
                    .with_priority(3),
            ),
        )
        .await
        .unwrap(),
    );
    for retry in 1..=2 {
        let j = fetch_one(&mut conn, "work").await;
        assert_eq!(j.retry_count, retry - 1);
        let (outcome, delay_ms) = fail_measured(&mut conn, &j).await;
        assert!(
            matches!(outcome, JobFailOutcome::Retrying { .. }),
            "{outcome:?}"
        );
        assert_eq!(delay_ms, 1500, "retry {retry}");
        let r = row(&mut conn, id).await;
        assert_eq!((r.state.as_str(), r.retry_count), ("retry", retry));
        // Not fetchable before its delay.
        assert!(queue::fetch(&mut conn, &["work".to_owned()], 1)
            .await
            .unwrap()
            .is_empty());
        make_due(&mut conn, id).await;
    }
    let j = fetch_one(&mut conn, "work").await;
    assert_eq!(j.last_error.as_deref(), Some("handler error"));
    let (outcome, _) = fail_measured(&mut conn, &j).await;
    let JobFailOutcome::Failed {
        dead_lettered: Some(dl),
    } = outcome
    else {
        panic!("expected Failed with a dead letter, got {outcome:?}");
    };
    let r = row(&mut conn, id).await;
    assert_eq!((r.state.as_str(), r.retry_count), ("failed", 2));
    assert!(r.completed_at.is_some());
    let d = row(&mut conn, dl).await;
    assert_eq!(
        (d.queue.as_str(), d.state.as_str()),
        ("work-dead", "created")
    );
    assert_eq!(d.payload, r.payload);
    let why = d.last_error.unwrap();
    assert!(
        why.contains(&id.to_string()) && why.contains("handler error"),
        "{why}"
    );
    // The failed job no longer holds its key.
    sent(
        queue::send_in(&mut conn, &job("work", json!({}), keyed("work:t1:A")))
            .await
            .unwrap(),
    );
}

#[tokio::test]
async fn exponential_backoff_doubles_with_jitter_and_respects_the_cap() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = sent(
        queue::send_in(
            &mut conn,
            &job(
                "backoff",
                json!({}),
                SendOptions::default()
                    .with_retry_limit(6)
                    .with_retry_delay(Duration::from_secs(1))
                    .with_retry_backoff(true)
                    .with_retry_delay_max(Duration::from_secs(5)),
            ),
        )
        .await
        .unwrap(),
    );
    // Equal jitter: retry n (0-based) waits in [d/2, d], d = min(5 s, 1 s * 2^n).
    let mut delays = Vec::new();
    for n in 0..6u32 {
        let j = fetch_one(&mut conn, "backoff").await;
        let (_, delay_ms) = fail_measured(&mut conn, &j).await;
        let d = (1000i64 << n).min(5000);
        assert!(
            (d / 2..=d).contains(&delay_ms),
            "retry {n}: delay {delay_ms} ms outside [{}, {d}]",
            d / 2
        );
        delays.push(delay_ms);
        make_due(&mut conn, id).await;
    }
    // The cap also bounds the jittered values, and the jitter really varies them
    // (four capped retries all equal would mean no jitter).
    assert!(delays.iter().all(|d| *d <= 5000), "{delays:?}");
    let capped: HashSet<i64> = delays[3..].iter().copied().collect();
    assert!(capped.len() > 1, "no jitter: {delays:?}");
    let j = fetch_one(&mut conn, "backoff").await;
    let (outcome, _) = fail_measured(&mut conn, &j).await;
    assert_eq!(
        outcome,
        JobFailOutcome::Failed {
            dead_lettered: None
        }
    );
}

#[tokio::test]
async fn a_permanent_failure_skips_the_remaining_retries() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = sent(
        queue::send_in(&mut conn, &job("perm", json!({}), SendOptions::default()))
            .await
            .unwrap(),
    );
    let j = fetch_one(&mut conn, "perm").await;
    let outcome = queue::fail(&mut conn, id, j.attempt, "bad payload", FailKind::Permanent)
        .await
        .unwrap();
    assert_eq!(
        outcome,
        JobFailOutcome::Failed {
            dead_lettered: None
        }
    );
    let r = row(&mut conn, id).await;
    assert_eq!((r.state.as_str(), r.retry_count), ("failed", 0));
}

#[tokio::test]
async fn send_batch_reports_duplicates_within_the_batch_and_against_existing_rows() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let existing = sent(
        queue::send_in(&mut conn, &job("b", json!("old"), keyed("k-existing")))
            .await
            .unwrap(),
    );
    let batch = vec![
        job("b", json!(0), keyed("k1")),
        job("b", json!(1), keyed("k-existing")),
        job("b", json!(2), keyed("k1")),
        job("b", json!(3), SendOptions::default()),
        job("b", json!(4), SendOptions::default()),
        job("other", json!(5), keyed("k1")),
        job("b", json!(6), keyed("k2").with_singleton_seconds(3600)),
        job("b", json!(7), keyed("k2")),
    ];
    let results = queue::send_batch(&mut conn, &batch).await.unwrap();
    assert_eq!(results.len(), batch.len());
    let is_sent: Vec<bool> = results
        .iter()
        .map(|r| matches!(r, SendResult::Sent(_)))
        .collect();
    assert_eq!(
        is_sent,
        vec![true, false, false, true, true, true, true, false],
        "{results:?}"
    );
    // Each Sent id is the row with that input's payload.
    for (i, r) in results.iter().enumerate() {
        if let SendResult::Sent(id) = r {
            let p: serde_json::Value =
                serde_json::from_str(&row(&mut conn, *id).await.payload).unwrap();
            assert_eq!(p, json!(i));
        }
    }
    assert_eq!(count(&mut conn, "SELECT count(*) AS n FROM jobs").await, 6);
    assert_eq!(row(&mut conn, existing).await.payload, "\"old\"");
    assert!(queue::send_batch(&mut conn, &[]).await.unwrap().is_empty());

    // An invalid job refuses the whole batch before anything is written.
    let bad = vec![
        job("b", json!(0), keyed("k9")),
        job("bad queue!", json!(1), keyed("k9")),
    ];
    assert!(matches!(
        queue::send_batch(&mut conn, &bad).await,
        Err(RepoError::Invalid(_))
    ));
    assert_eq!(count(&mut conn, "SELECT count(*) AS n FROM jobs").await, 6);
}

#[tokio::test]
async fn throttled_key_allows_one_job_per_window_whatever_its_state() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let throttled = || job("t", json!({}), keyed("tick").with_singleton_seconds(3600));
    sent(queue::send_in(&mut conn, &throttled()).await.unwrap());
    let j = fetch_one(&mut conn, "t").await;
    queue::complete(&mut conn, j.id, j.attempt, None)
        .await
        .unwrap();
    // Completed, but still inside the window.
    assert_eq!(
        queue::send_in(&mut conn, &throttled()).await.unwrap(),
        SendResult::Duplicate
    );
    // Without the throttle the key is free again.
    sent(
        queue::send_in(&mut conn, &job("t", json!({}), keyed("tick")))
            .await
            .unwrap(),
    );
}

#[tokio::test]
async fn cancel_retry_now_and_complete_with_output() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let a = sent(
        queue::send_in(&mut conn, &job("c", json!("a"), SendOptions::default()))
            .await
            .unwrap(),
    );
    let j = fetch_one(&mut conn, "c").await;
    assert_eq!(
        queue::retry_now(&mut conn, a, j.attempt).await.unwrap(),
        JobRetryOutcome::Requeued
    );
    let r = row(&mut conn, a).await;
    // Giving a job back is not a failure.
    assert_eq!((r.state.as_str(), r.retry_count), ("retry", 0));
    let j = fetch_one(&mut conn, "c").await;
    assert_eq!(j.attempt, 2);
    assert_eq!(
        queue::cancel(&mut conn, a, j.attempt).await.unwrap(),
        JobCancelOutcome::Cancelled
    );
    assert_eq!(row(&mut conn, a).await.state, "cancelled");
    assert_eq!(
        queue::complete(&mut conn, a, j.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Fenced
    );

    let b = sent(
        queue::send_in(&mut conn, &job("c", json!("b"), SendOptions::default()))
            .await
            .unwrap(),
    );
    let j = fetch_one(&mut conn, "c").await;
    assert_eq!(
        queue::complete(&mut conn, b, j.attempt, Some(&json!({ "ok": true })))
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
    #[derive(diesel::QueryableByName)]
    struct Out {
        #[diesel(sql_type = Nullable<Text>)]
        output: Option<String>,
    }
    let o: Out = diesel::sql_query("SELECT output::text FROM job_states WHERE id = $1")
        .bind::<Text, _>(b.to_string())
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(o.output.as_deref(), Some(r#"{"ok": true}"#));
    // complete_many reports per entry, in input order; a stale token is Fenced.
    let c = sent(
        queue::send_in(&mut conn, &job("c", json!("c"), SendOptions::default()))
            .await
            .unwrap(),
    );
    let d = sent(
        queue::send_in(&mut conn, &job("c", json!("d"), SendOptions::default()))
            .await
            .unwrap(),
    );
    let jobs = queue::fetch(&mut conn, &["c".to_owned()], 2).await.unwrap();
    assert_eq!(jobs.iter().map(|j| j.id).collect::<Vec<_>>(), vec![c, d]);
    let outcomes = queue::complete_many(
        &mut conn,
        &[
            (b, 1),
            (c, jobs[0].attempt + 1),
            (d, jobs[1].attempt),
            (c, jobs[0].attempt),
        ],
    )
    .await
    .unwrap();
    assert_eq!(
        outcomes,
        vec![
            JobCompleteOutcome::Fenced,
            JobCompleteOutcome::Fenced,
            JobCompleteOutcome::Completed,
            JobCompleteOutcome::Completed
        ]
    );
    assert_eq!(row(&mut conn, c).await.state, "completed");
}

#[tokio::test]
async fn maintenance_expires_into_dead_letter_deletes_after_retention_and_runs_one_at_a_time() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = sent(
        queue::send_in(
            &mut conn,
            &job(
                "m",
                json!({ "x": 1 }),
                SendOptions::default()
                    .with_retry_limit(0)
                    .with_expire_in(Duration::from_millis(100))
                    .with_dead_letter("m-dead".to_owned()),
            ),
        )
        .await
        .unwrap(),
    );
    fetch_one(&mut conn, "m").await;
    wait_until_lease_expired(&mut conn, id).await;

    // While another session holds the maintenance lock, a run is skipped.
    let mut holder = db.conn().await;
    holder.batch_execute("BEGIN").await.unwrap();
    diesel::sql_query("SELECT pg_advisory_xact_lock($1)")
        .bind::<BigInt, _>(queue::MAINTENANCE_LOCK_KEY)
        .execute(&mut holder)
        .await
        .unwrap();
    assert_eq!(
        queue::maintain(&mut conn, &MaintenanceConfig::default())
            .await
            .unwrap(),
        MaintenanceOutcome::Skipped
    );
    assert_eq!(row(&mut conn, id).await.state, "active");
    holder.batch_execute("COMMIT").await.unwrap();

    let MaintenanceOutcome::Ran(report) = queue::maintain(&mut conn, &MaintenanceConfig::default())
        .await
        .unwrap()
    else {
        panic!("skipped after the lock was released");
    };
    assert_eq!((report.expired_failed, report.dead_lettered), (1, 1));
    assert_eq!(row(&mut conn, id).await.state, "failed");
    assert_eq!(
        count(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE queue = 'm-dead' AND state = 'created' \
             AND payload = '{\"x\": 1}'"
        )
        .await,
        1
    );

    // Retention: a completed job back-dated past it is deleted, a fresh one is kept.
    let old = sent(
        queue::send_in(&mut conn, &job("r", json!({}), SendOptions::default()))
            .await
            .unwrap(),
    );
    let j = fetch_one(&mut conn, "r").await;
    queue::complete(&mut conn, old, j.attempt, None)
        .await
        .unwrap();
    let fresh = sent(
        queue::send_in(&mut conn, &job("r", json!({}), SendOptions::default()))
            .await
            .unwrap(),
    );
    let j = fetch_one(&mut conn, "r").await;
    queue::complete(&mut conn, fresh, j.attempt, None)
        .await
        .unwrap();
    // A job without a singleton key is completed by its closure.
    diesel::sql_query(
        "UPDATE job_closures SET closed_at = now() - interval '2 days' WHERE job_id = $1",
    )
    .bind::<Text, _>(old.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    let config = MaintenanceConfig::default().with_retention(Duration::from_secs(24 * 3600));
    let MaintenanceOutcome::Ran(report) = queue::maintain(&mut conn, &config).await.unwrap() else {
        panic!("skipped");
    };
    assert_eq!(report.deleted, 1);
    assert_eq!(
        count(
            &mut conn,
            &format!("SELECT count(*) AS n FROM jobs WHERE id = '{old}'")
        )
        .await,
        0
    );
    assert_eq!(row(&mut conn, fresh).await.state, "completed");
}

#[tokio::test]
async fn queue_stats_count_jobs_per_queue_and_state() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for _ in 0..3 {
        sent(
            queue::send_in(&mut conn, &job("s1", json!({}), SendOptions::default()))
                .await
                .unwrap(),
        );
    }
    sent(
        queue::send_in(&mut conn, &job("s2", json!({}), SendOptions::default()))
            .await
            .unwrap(),
    );
    let j = fetch_one(&mut conn, "s1").await;
    queue::complete(&mut conn, j.id, j.attempt, None)
        .await
        .unwrap();
    fetch_one(&mut conn, "s1").await;

    let stats = queue::queue_stats(&mut conn).await.unwrap();
    assert_eq!(stats.queues.len(), 2);
    let s1 = stats.queues["s1"];
    assert_eq!(
        (s1.created, s1.active, s1.completed, s1.failed),
        (1, 1, 1, 0)
    );
    assert_eq!(stats.queues["s2"].created, 1);
}

#[tokio::test]
async fn invalid_send_options_are_refused_before_writing() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for bad in [
        job("bad name", json!({}), SendOptions::default()),
        job(
            "q",
            json!({}),
            SendOptions::default().with_dead_letter("no spaces allowed".to_owned()),
        ),
        job(
            "q",
            json!({}),
            SendOptions::default().with_singleton_seconds(10),
        ),
    ] {
        let err = queue::send_in(&mut conn, &bad).await.unwrap_err();
        assert!(matches!(err, RepoError::Invalid(_)), "{err:?}");
    }
    assert_eq!(count(&mut conn, "SELECT count(*) AS n FROM jobs").await, 0);
}

#[derive(diesel::QueryableByName)]
struct IndexReads {
    #[diesel(sql_type = BigInt)]
    lease: i64,
    #[diesel(sql_type = BigInt)]
    pkey: i64,
}

/// Index entries read so far through the claims' indexes by deadline or
/// transaction (not their key) and through the jobs' primary key, as
/// this session's statistics show them (flushed first: PostgreSQL 15 reports a
/// backend's counters only now and then).
async fn index_reads(conn: &mut AsyncPgConnection) -> IndexReads {
    conn.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    diesel::sql_query(
        "SELECT coalesce(sum(idx_tup_read) FILTER (WHERE relname = 'job_claims'
                                                      AND indexrelname <> 'job_claims_pkey'),
                         0)::bigint AS lease,
                sum(idx_tup_read) FILTER (WHERE indexrelname = 'jobs_pkey')::bigint AS pkey
           FROM pg_stat_user_indexes WHERE relname IN ('jobs', 'job_claims')",
    )
    .get_result(conn)
    .await
    .unwrap()
}

/// Statistics taken while no job is active (a bulk insert, then ANALYZE) used to
/// make the planner read every active job through the lease index for each fenced
/// statement, once per token in `complete_many`. The fenced statements must probe
/// the primary key whatever the statistics say.
#[tokio::test]
async fn fenced_statements_probe_the_primary_key_when_statistics_say_no_job_is_active() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let batch: Vec<JobToSend> = (0..2000)
        .map(|i| job("plan", json!(i), SendOptions::default()))
        .collect();
    queue::send_batch(&mut conn, &batch).await.unwrap();
    conn.batch_execute("VACUUM ANALYZE jobs").await.unwrap();
    let jobs = queue::fetch(&mut conn, &["plan".to_owned()], 1000)
        .await
        .unwrap();
    assert_eq!(jobs.len(), 1000);
    let before = index_reads(&mut conn).await;

    let tokens: Vec<(JobId, i32)> = jobs[..500].iter().map(|j| (j.id, j.attempt)).collect();
    // Several runs: PostgreSQL may switch a prepared statement to a generic plan
    // after five, and that plan must be right too.
    for chunk in tokens.chunks(50) {
        let outcomes = queue::complete_many(&mut conn, chunk).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == JobCompleteOutcome::Completed));
    }
    // The batched renewal and release share complete_many's fence.
    let rest: Vec<(JobId, i32)> = jobs[510..].iter().map(|j| (j.id, j.attempt)).collect();
    for chunk in rest.chunks(50).take(6) {
        let renewed = queue::renew_leases(&mut conn, chunk).await.unwrap();
        assert!(renewed
            .iter()
            .all(|o| matches!(o, RenewLeaseOutcome::Renewed { .. })));
    }
    for chunk in rest.chunks(50).skip(6) {
        let released = queue::retry_now_many(&mut conn, chunk).await.unwrap();
        assert!(released.iter().all(|o| *o == JobRetryOutcome::Requeued));
    }
    for j in &jobs[500..510] {
        assert_eq!(
            queue::complete(&mut conn, j.id, j.attempt, None)
                .await
                .unwrap(),
            JobCompleteOutcome::Completed
        );
    }
    let after = index_reads(&mut conn).await;

    assert_eq!(
        after.lease - before.lease,
        0,
        "a fenced statement scanned the claims by deadline or transaction"
    );
    assert!(
        after.pkey - before.pkey >= 1000,
        "1000 fenced changes read {} primary-key entries",
        after.pkey - before.pkey
    );
}

/// The batched renewal and release are fenced per entry, like their single-job
/// forms: a token that was taken over is `Fenced` and its row is left alone, the
/// others are renewed (later lease end) or given back (`retry`, no retry counted,
/// the listeners woken).
#[tokio::test]
async fn renew_leases_and_retry_now_many_fence_each_entry() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for i in 0..3 {
        queue::send_in(&mut conn, &job("batch", json!(i), SendOptions::default()))
            .await
            .unwrap();
    }
    let jobs = queue::fetch(&mut conn, &["batch".to_owned()], 3)
        .await
        .unwrap();
    let (a, b, c) = (&jobs[0], &jobs[1], &jobs[2]);
    // c is taken over: given back and fetched again, under a new token.
    queue::retry_now(&mut conn, c.id, c.attempt).await.unwrap();
    let c2 = fetch_one(&mut conn, "batch").await;
    assert_eq!((c2.id, c2.attempt), (c.id, c.attempt + 1));

    let stale = (c.id, c.attempt);
    let renewed = queue::renew_leases(&mut conn, &[(a.id, a.attempt), stale, (b.id, b.attempt)])
        .await
        .unwrap();
    let [RenewLeaseOutcome::Renewed {
        lease_expires_at: la,
    }, RenewLeaseOutcome::Fenced, RenewLeaseOutcome::Renewed { .. }] = renewed[..]
    else {
        panic!("{renewed:?}");
    };
    assert!(la > a.lease_expires_at, "{la} <= {}", a.lease_expires_at);
    assert_eq!(queue::renew_leases(&mut conn, &[]).await.unwrap(), vec![]);

    // Listening from here on: only the release can notify.
    let mut listener = db.conn().await;
    listener
        .batch_execute("LISTEN idemstage_jobs")
        .await
        .unwrap();
    let released = queue::retry_now_many(&mut conn, &[stale, (b.id, b.attempt), (a.id, a.attempt)])
        .await
        .unwrap();
    assert_eq!(
        released,
        vec![
            JobRetryOutcome::Fenced,
            JobRetryOutcome::Requeued,
            JobRetryOutcome::Requeued
        ]
    );
    for j in [a, b] {
        let r = row(&mut conn, j.id).await;
        assert_eq!((r.state.as_str(), r.retry_count), ("retry", 0));
    }
    // The new holder's job is untouched, and its token still works.
    assert_eq!(row(&mut conn, c.id).await.state, "active");
    assert_eq!(
        queue::complete(&mut conn, c2.id, c2.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
    // The release woke the listeners of the queue.
    let mut notifications = std::pin::pin!(listener.notifications_stream());
    let n = tokio::time::timeout(Duration::from_secs(30), notifications.next())
        .await
        .expect("the release notified nobody")
        .expect("stream ended")
        .unwrap();
    assert_eq!(n.payload, "batch");
}

#[tokio::test]
async fn queue_depths_count_ready_delayed_and_active_jobs_per_queue_and_the_oldest_ready_age() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for i in 0..3 {
        sent(
            queue::send_in(
                &mut conn,
                &job("depth_a", json!({ "i": i }), SendOptions::default()),
            )
            .await
            .unwrap(),
        );
    }
    let later = SendOptions::default().with_start_after(Duration::from_secs(3600));
    sent(
        queue::send_in(&mut conn, &job("depth_a", json!({ "later": 1 }), later))
            .await
            .unwrap(),
    );
    let done = sent(
        queue::send_in(
            &mut conn,
            &job("depth_b", json!({}), SendOptions::default()),
        )
        .await
        .unwrap(),
    );
    // The oldest ready job of depth_a has been due for a minute.
    diesel::sql_query(
        "UPDATE jobs SET start_after = now() - interval '60 seconds' \
         WHERE id = (SELECT id FROM jobs WHERE queue = 'depth_a' ORDER BY id LIMIT 1)",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let active = fetch_one(&mut conn, "depth_a").await;
    let b = fetch_one(&mut conn, "depth_b").await;
    assert_eq!(b.id, done);
    assert_eq!(
        queue::complete(&mut conn, b.id, b.attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
    let queues: Vec<String> = ["depth_b", "depth_a", "depth_none"]
        .map(str::to_owned)
        .into();
    let depths = queue::queue_depths(&mut conn, &queues).await.unwrap();
    let shape: Vec<(&str, i64, i64, i64)> = depths
        .iter()
        .map(|d| (d.queue.as_str(), d.ready, d.delayed, d.active))
        .collect();
    // In the order asked; the completed job counts nowhere; a queue without jobs is zeros.
    assert_eq!(
        shape,
        vec![
            ("depth_b", 0, 0, 0),
            ("depth_a", 2, 1, 1),
            ("depth_none", 0, 0, 0)
        ]
    );
    assert_eq!(depths[0].oldest_ready_s, 0.0);
    assert_eq!(depths[2].oldest_ready_s, 0.0);
    // The fetch took the oldest (the one due for a minute): the age is of the
    // oldest ready job left, sent moments ago.
    assert_eq!(row(&mut conn, active.id).await.state, "active");
    assert!(
        (0.0..60.0).contains(&depths[1].oldest_ready_s),
        "{depths:?}"
    );
    // Once the other two are older, the age follows.
    diesel::sql_query(
        "UPDATE jobs SET start_after = now() - interval '90 seconds' \
         WHERE queue = 'depth_a' AND state = 'created' AND start_after <= now()",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let depths = queue::queue_depths(&mut conn, &queues[1..2]).await.unwrap();
    assert!(
        (90.0..120.0).contains(&depths[0].oldest_ready_s),
        "{depths:?}"
    );
}

#[derive(diesel::QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    value: String,
}

async fn synchronous_commit(conn: &mut AsyncPgConnection) -> String {
    diesel::sql_query("SELECT current_setting('synchronous_commit') AS value")
        .get_result::<Setting>(conn)
        .await
        .unwrap()
        .value
}

/// A session with `synchronous_commit = on` (the test cluster runs without it)
/// that has sent `jobs` jobs to queue `lease`.
async fn durable_session_with_jobs(db: &TestDb, jobs: usize) -> AsyncPgConnection {
    let mut conn = db.conn().await;
    conn.batch_execute("SET synchronous_commit = on")
        .await
        .unwrap();
    for i in 0..jobs {
        sent(
            queue::send_in(
                &mut conn,
                &job("lease", json!({ "i": i }), SendOptions::default()),
            )
            .await
            .unwrap(),
        );
    }
    conn
}

#[tokio::test]
async fn an_asynchronous_fetch_commits_its_leases_and_leaves_the_session_durable() {
    let db = TestDb::new().await;
    let mut conn = durable_session_with_jobs(&db, 2).await;
    let fetched = queue::fetch_with_commit(
        &mut conn,
        &["lease".to_owned()],
        10,
        queue::LeaseCommit::Asynchronous,
    )
    .await
    .unwrap();
    assert_eq!(fetched.len(), 2);
    // Committed: another session sees both leased.
    let mut other = db.conn().await;
    assert_eq!(
        count(
            &mut other,
            "SELECT count(*) AS n FROM job_states WHERE queue = 'lease' AND state = 'active' AND attempt = 1"
        )
        .await,
        2
    );
    // `off` lasted only for the fetch's own transaction.
    assert_eq!(synchronous_commit(&mut conn).await, "on");
}

#[tokio::test]
async fn an_asynchronous_fetch_inside_a_callers_transaction_leaves_its_commit_durable() {
    let db = TestDb::new().await;
    let mut conn = durable_session_with_jobs(&db, 1).await;
    let inside = conn
        .transaction::<(usize, String), TxErr, _>(async |c| {
            let fetched = queue::fetch_with_commit(
                c,
                &["lease".to_owned()],
                10,
                queue::LeaseCommit::Asynchronous,
            )
            .await?;
            // The caller's own writes would commit with this setting.
            Ok((fetched.len(), synchronous_commit(c).await))
        })
        .await
        .unwrap();
    assert_eq!(inside, (1, "on".to_owned()));
}
