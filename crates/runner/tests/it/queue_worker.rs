//! Integration tests of the runner crate (one binary): the queue worker loop against
//! a real PostgreSQL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use diesel::sql_types::{BigInt, Integer, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{FetchedJob, JobCompleteOutcome, JobId, JobToSend, SendOptions, SendResult};
use idemstage_persistence::{connect_pool, queue, PgPool, PoolConfig};
use idemstage_runner::{
    handler_fn, Handled, HandlerError, JobHandler, QueueWorker, QueueWorkerConfig, WorkerStats,
    WorkerStatsSnapshot,
};
use idemstage_testkit::{count, TestDb};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Deadline of every wait: turns a hang into a failure, asserts no duration.
pub(crate) const DEADLINE: Duration = Duration::from_secs(60);

pub(crate) fn config(queue: &str) -> QueueWorkerConfig {
    QueueWorkerConfig::for_queues([queue])
        .with_concurrency(2)
        .with_batch_size(2)
        .with_poll_interval(Duration::from_millis(200))
        .with_maintenance_interval(Duration::from_millis(200))
        .with_shutdown_grace(Duration::from_secs(30))
        .with_error_backoff(Duration::from_millis(20), Duration::from_millis(200))
}

pub(crate) struct Running {
    pub(crate) stop: CancellationToken,
    pub(crate) stats: Arc<WorkerStats>,
    pub(crate) handle: JoinHandle<WorkerStatsSnapshot>,
}

impl Running {
    pub(crate) async fn shutdown(self) -> WorkerStatsSnapshot {
        self.stop.cancel();
        tokio::time::timeout(DEADLINE, self.handle)
            .await
            .expect("worker did not stop")
            .expect("worker task panicked")
    }
}

pub(crate) fn start<H: JobHandler>(
    pool: PgPool,
    url: &str,
    cfg: QueueWorkerConfig,
    handler: H,
) -> Running {
    let worker = QueueWorker::new(pool, url, cfg, handler).unwrap();
    let stats = worker.stats();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(worker.run(stop.clone()));
    Running {
        stop,
        stats,
        handle,
    }
}

pub(crate) fn job(queue: &str, payload: serde_json::Value, options: SendOptions) -> JobToSend {
    JobToSend {
        tenant: None,
        queue: queue.to_owned(),
        payload,
        options,
    }
}

pub(crate) async fn send(conn: &mut AsyncPgConnection, j: JobToSend) -> JobId {
    match queue::send_in(conn, &j).await.unwrap() {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("unexpected duplicate"),
    }
}

#[derive(diesel::QueryableByName, Debug, Clone)]
pub(crate) struct JobRow {
    #[diesel(sql_type = Text)]
    pub(crate) state: String,
    #[diesel(sql_type = Integer)]
    pub(crate) retry_count: i32,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) last_error: Option<String>,
}

pub(crate) async fn row(conn: &mut AsyncPgConnection, id: JobId) -> JobRow {
    diesel::sql_query("SELECT state, retry_count, last_error FROM job_states WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .get_result(conn)
        .await
        .unwrap()
}

/// Polls the job row until it reaches `state` (the database decides; the sleep only
/// paces the polling).
pub(crate) async fn wait_for_state(conn: &mut AsyncPgConnection, id: JobId, state: &str) -> JobRow {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let r = row(conn, id).await;
        if r.state == state {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "job {id} never reached {state}: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[derive(Deserialize, Debug)]
struct Work {
    tenant: String,
    #[serde(default)]
    fail: bool,
    #[serde(default)]
    panic: bool,
}

/// Handler used by several tests: records the tenants it handled.
fn work_handler(seen: Arc<Mutex<Vec<String>>>) -> impl JobHandler<Payload = Work> {
    handler_fn(move |_job: FetchedJob, w: Work| {
        let seen = seen.clone();
        async move {
            if w.panic {
                panic!("handler exploded on {}", w.tenant);
            }
            if w.fail {
                return Err(HandlerError::transient(format!("cannot do {}", w.tenant)));
            }
            seen.lock().unwrap().push(w.tenant);
            Ok(())
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_completes_ok_jobs_and_fails_erroring_ones_with_retries() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let w = start(
        db.pool(4).await,
        db.url(),
        config("w"),
        work_handler(seen.clone()),
    );

    let ok = send(
        &mut conn,
        job("w", json!({ "tenant": "t1" }), SendOptions::default()),
    )
    .await;
    let bad = send(
        &mut conn,
        job(
            "w",
            json!({ "tenant": "t2", "fail": true }),
            SendOptions::default().with_retry_limit(1),
        ),
    )
    .await;
    wait_for_state(&mut conn, ok, "completed").await;
    let r = wait_for_state(&mut conn, bad, "failed").await;
    assert_eq!(r.retry_count, 1);
    assert_eq!(r.last_error.as_deref(), Some("cannot do t2"));
    assert_eq!(seen.lock().unwrap().as_slice(), ["t1"]);

    let stats = w.shutdown().await;
    assert_eq!((stats.completed, stats.failed, stats.fenced), (1, 2, 0));
}

/// Completes each job itself, with an output, and says so.
struct SelfCompleting {
    pool: PgPool,
}

impl JobHandler for SelfCompleting {
    type Payload = serde_json::Value;
    async fn handle(
        &self,
        job: FetchedJob,
        _payload: serde_json::Value,
    ) -> Result<Handled, HandlerError> {
        let mut conn = idemstage_persistence::get(&self.pool)
            .await
            .map_err(HandlerError::transient)?;
        let output = json!({ "completed_by": "handler" });
        match queue::complete(&mut conn, job.id, job.attempt, Some(&output))
            .await
            .map_err(HandlerError::transient)?
        {
            JobCompleteOutcome::Completed => Ok(Handled::AlreadyCompleted),
            JobCompleteOutcome::Fenced => Err(HandlerError::permanent("fenced")),
        }
    }
}

/// A handler that completed its job itself (as the stage worker does inside the
/// stage's transaction) is counted as completed, and the worker writes nothing
/// more: no second completion, which would come back `Fenced`.
#[tokio::test]
async fn a_job_its_handler_completed_is_recorded_without_a_second_write() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let pool = db.pool(4).await;
    let w = start(pool.clone(), db.url(), config("s"), SelfCompleting { pool });
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            send(
                &mut conn,
                job("s", json!({ "i": i }), SendOptions::default()),
            )
            .await,
        );
    }
    for id in &ids {
        wait_for_state(&mut conn, *id, "completed").await;
    }
    let stats = w.shutdown().await;
    assert_eq!((stats.completed, stats.failed, stats.fenced), (5, 0, 0));
    assert_eq!(
        count(
            &mut conn,
            "SELECT 1 FROM job_states WHERE output->>'completed_by' = 'handler'"
        )
        .await,
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_payload_row_fails_with_a_readable_error_and_the_worker_goes_on() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    // Inserted by hand, as a foreign producer or an old version might.
    let malformed = JobId::new();
    conn.batch_execute(&format!(
        "INSERT INTO jobs (id, queue, payload, retry_limit)
         VALUES ('{malformed}', 'typed', '{{\"tenat\": \"t1\"}}', 3)"
    ))
    .await
    .unwrap();
    let w = start(
        db.pool(4).await,
        db.url(),
        config("typed"),
        work_handler(seen.clone()),
    );

    let r = wait_for_state(&mut conn, malformed, "failed").await;
    assert_eq!(
        r.last_error.as_deref(),
        Some("invalid payload for queue typed: missing field `tenant`")
    );
    // Permanent: the same bytes would not parse on a retry.
    assert_eq!(r.retry_count, 0);

    let next = send(
        &mut conn,
        job("typed", json!({ "tenant": "t9" }), SendOptions::default()),
    )
    .await;
    wait_for_state(&mut conn, next, "completed").await;
    assert_eq!(seen.lock().unwrap().as_slice(), ["t9"]);
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_fails_its_job_and_the_worker_lives_on() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let w = start(
        db.pool(4).await,
        db.url(),
        config("p"),
        work_handler(seen.clone()),
    );

    let boom = send(
        &mut conn,
        job(
            "p",
            json!({ "tenant": "t1", "panic": true }),
            SendOptions::default().with_retry_limit(1),
        ),
    )
    .await;
    let r = wait_for_state(&mut conn, boom, "failed").await;
    // Retried once (a panic may be transient), then failed.
    assert_eq!(r.retry_count, 1);
    assert_eq!(
        r.last_error.as_deref(),
        Some("handler panicked: handler exploded on t1")
    );
    let after = send(
        &mut conn,
        job("p", json!({ "tenant": "t2" }), SendOptions::default()),
    )
    .await;
    wait_for_state(&mut conn, after, "completed").await;
    let stats = w.shutdown().await;
    assert_eq!((stats.failed, stats.completed), (2, 1));
}

/// A handler that reports when it starts and then waits for a release signal.
fn gated_handler(
    started: mpsc::UnboundedSender<JobId>,
    release: CancellationToken,
) -> impl JobHandler<Payload = serde_json::Value> {
    handler_fn(move |job: FetchedJob, _p: serde_json::Value| {
        let (started, release) = (started.clone(), release.clone());
        async move {
            started.send(job.id).unwrap();
            release.cancelled().await;
            Ok(())
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_fetching_and_waits_for_in_flight_handlers() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (tx, mut started) = mpsc::unbounded_channel();
    let release = CancellationToken::new();
    let cfg = config("g").with_concurrency(1).with_batch_size(1);
    let w = start(
        db.pool(4).await,
        db.url(),
        cfg,
        gated_handler(tx, release.clone()),
    );
    let first = send(&mut conn, job("g", json!({}), SendOptions::default())).await;
    let second = send(&mut conn, job("g", json!({}), SendOptions::default())).await;
    assert_eq!(started.recv().await, Some(first));

    w.stop.cancel();
    // The worker is waiting for the handler: it has not finished, and the job is
    // still active (not given back).
    assert!(!w.handle.is_finished());
    assert_eq!(row(&mut conn, first).await.state, "active");
    release.cancel();
    let stats = w.shutdown().await;
    assert_eq!(stats.completed, 1);
    assert_eq!(row(&mut conn, first).await.state, "completed");
    // Nothing was fetched after the shutdown began.
    assert_eq!(row(&mut conn, second).await.state, "created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_grace_period_unfinished_jobs_are_given_back_without_a_failure() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (tx, mut started) = mpsc::unbounded_channel();
    let never = CancellationToken::new();
    let cfg = config("h").with_shutdown_grace(Duration::from_millis(100));
    let w = start(db.pool(4).await, db.url(), cfg, gated_handler(tx, never));
    let stuck = send(&mut conn, job("h", json!({}), SendOptions::default())).await;
    assert_eq!(started.recv().await, Some(stuck));
    let stats = w.shutdown().await;
    assert_eq!((stats.released, stats.completed, stats.failed), (1, 0, 0));
    let r = row(&mut conn, stuck).await;
    assert_eq!((r.state.as_str(), r.retry_count), ("retry", 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_running_past_its_timeout_is_aborted_and_its_job_failed() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let (tx, mut started) = mpsc::unbounded_channel();
    let w = start(
        db.pool(4).await,
        db.url(),
        config("slow").with_handler_timeout(Duration::from_millis(300)),
        gated_handler(tx, CancellationToken::new()),
    );
    let slow = send(
        &mut conn,
        job(
            "slow",
            json!({}),
            SendOptions::default()
                .with_retry_limit(0)
                .with_expire_in(Duration::from_millis(200)),
        ),
    )
    .await;
    assert_eq!(started.recv().await, Some(slow));
    let r = wait_for_state(&mut conn, slow, "failed").await;
    // The lease (200 ms) is renewed while the handler runs: the handler's own
    // timeout (300 ms) is what ends it, not maintenance.
    let why = r.last_error.unwrap();
    assert!(why.contains("did not finish within 300ms"), "{why}");
    let stats = w.shutdown().await;
    assert_eq!((stats.failed, stats.fenced), (1, 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetch_errors_while_the_database_refuses_connections_are_retried() {
    let db = TestDb::new().await;
    let mut admin = idemstage_persistence::connect(&idemstage_testkit::server_url())
        .await
        .unwrap();
    // A pool that gives up quickly, so that the outage shows up as fetch errors.
    let pool = connect_pool(
        db.url(),
        PoolConfig::default()
            .with_max_size(2)
            .with_connection_timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let w = start(pool, db.url(), config("down"), work_handler(seen.clone()));

    // The outage: no new connections, and the existing ones are terminated. Keep
    // terminating while waiting: a connection that was being established when
    // connections were refused can still come up (seen under CPU load).
    let name = db.name().to_owned();
    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" WITH ALLOW_CONNECTIONS false"
        ))
        .await
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    while w.stats.snapshot().fetch_errors < 3 {
        admin
            .batch_execute(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = '{name}' AND pid <> pg_backend_pid()"
            ))
            .await
            .unwrap();
        assert!(
            Instant::now() < deadline,
            "no fetch errors during the outage"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!w.handle.is_finished(), "the worker gave up");

    admin
        .batch_execute(&format!(
            "ALTER DATABASE \"{name}\" WITH ALLOW_CONNECTIONS true"
        ))
        .await
        .unwrap();
    let mut conn = db.conn().await;
    let id = send(
        &mut conn,
        job("down", json!({ "tenant": "t1" }), SendOptions::default()),
    )
    .await;
    wait_for_state(&mut conn, id, "completed").await;
    w.shutdown().await;
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Pickup latency of an idle worker: from `send` returning (committed) to the
/// handler starting. Printed, not asserted. The poll interval is far longer than
/// the deadline, so every pickup here must come from LISTEN/NOTIFY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_worker_pickup_latency_via_notify() {
    const SENDS: usize = 50;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let starts: Arc<Mutex<HashMap<JobId, Instant>>> = Arc::default();
    let (tx, mut started) = mpsc::unbounded_channel();
    let handler = {
        let starts = starts.clone();
        handler_fn(move |job: FetchedJob, _p: serde_json::Value| {
            let at = Instant::now();
            starts.lock().unwrap().insert(job.id, at);
            tx.send(job.id).unwrap();
            async { Ok(()) }
        })
    };
    let cfg = config("lat")
        .with_poll_interval(Duration::from_secs(3600))
        .with_maintenance_interval(Duration::from_secs(3600));
    let w = start(db.pool(4).await, db.url(), cfg, handler);
    // Let the worker reach its idle wait: its first (empty) fetch has run once the
    // listener woke it and it fetched again; a warm-up job proves the path works.
    let warm = send(&mut conn, job("lat", json!({}), SendOptions::default())).await;
    assert_eq!(
        tokio::time::timeout(DEADLINE, started.recv())
            .await
            .unwrap(),
        Some(warm)
    );
    wait_for_state(&mut conn, warm, "completed").await;

    let mut latencies = Vec::with_capacity(SENDS);
    for _ in 0..SENDS {
        let id = send(&mut conn, job("lat", json!({}), SendOptions::default())).await;
        let sent_at = Instant::now();
        let got = tokio::time::timeout(DEADLINE, started.recv())
            .await
            .expect("job not picked up: is NOTIFY working?");
        assert_eq!(got, Some(id));
        let start = starts.lock().unwrap()[&id];
        // The handler can start before the client has read send's reply.
        latencies.push(start.saturating_duration_since(sent_at));
        wait_for_state(&mut conn, id, "completed").await;
    }
    latencies.sort();
    eprintln!(
        "pickup latency of an idle worker over {SENDS} sends: p50 {:?}, p99 {:?}, max {:?}",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99),
        latencies[SENDS - 1]
    );
    let stats = w.shutdown().await;
    assert_eq!(stats.completed, SENDS as u64 + 1);
    #[derive(diesel::QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let c: Count =
        diesel::sql_query("SELECT count(*) AS n FROM job_states WHERE state = 'completed'")
            .get_result(&mut conn)
            .await
            .unwrap();
    assert_eq!(c.n, SENDS as i64 + 1);
}

/// Completions that arrive while a completion statement runs go together in the
/// next one: one statement and one commit for many jobs. One job's closure is
/// held by an open transaction that inserted it (a completion of a job without
/// a singleton key inserts its closure, and waits for the other's), so the
/// statement that completes it waits until the other handlers have finished;
/// the holder then rolls back. Jobs completed by one statement share its
/// `now()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_that_arrive_together_share_one_statement() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut ids = Vec::new();
    for i in 0..16 {
        ids.push(
            send(
                &mut conn,
                job("c", json!({ "i": i }), SendOptions::default()),
            )
            .await,
        );
    }
    let (started_tx, mut started_rx) = mpsc::unbounded_channel();
    let release = CancellationToken::new();
    let mut cfg = config("c");
    cfg.concurrency = 16;
    cfg.batch_size = 16;
    let w = start(
        db.pool(20).await,
        db.url(),
        cfg,
        gated_handler(started_tx, release.clone()),
    );
    for _ in 0..16 {
        tokio::time::timeout(DEADLINE, started_rx.recv())
            .await
            .expect("a handler never started");
    }
    let mut locker = db.conn().await;
    locker
        .batch_execute(&format!(
            "BEGIN; INSERT INTO job_closures (ready_seq, job_id, attempt, queue, tenant_id,
                                              priority, outcome)
                    SELECT ready_seq, id, 0, queue, tenant_id, priority, 'completed'
                      FROM jobs WHERE id = '{}'",
            ids[0]
        ))
        .await
        .unwrap();
    release.cancel();
    let waiting = "SELECT 1 FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let deadline = Instant::now() + DEADLINE;
    while count(&mut conn, waiting).await == 0 {
        assert!(
            Instant::now() < deadline,
            "no completion waited for the lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    locker.batch_execute("ROLLBACK").await.unwrap();
    for id in &ids {
        wait_for_state(&mut conn, *id, "completed").await;
    }
    let stats = w.shutdown().await;
    assert_eq!((stats.completed, stats.fenced), (16, 0));
    let statements = count(
        &mut conn,
        "SELECT DISTINCT completed_at FROM job_states WHERE queue = 'c'",
    )
    .await;
    assert!(
        statements < 16,
        "16 completions took {statements} statements"
    );
}
