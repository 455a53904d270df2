//! A job's lease is a claim appended to `job_claims` beside the job's row
//! (migration `2026-12-05-090000_job_claims`): the fetch writes no version of
//! the job's row, and expiry finds every claim whose lease ran out, one that
//! committed after its deadline had passed maintenance's mark included.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{JobCompleteOutcome, JobId, JobToSend, SendOptions, SendResult};
use idemstage_persistence::queue::{self, MaintenanceConfig, MaintenanceOutcome};
use idemstage_testkit::TestDb;
use serde_json::json;

use crate::support::stat_around;

async fn send(conn: &mut AsyncPgConnection, queue_name: &str, options: SendOptions) -> JobId {
    let job = JobToSend {
        tenant: None,
        queue: queue_name.to_owned(),
        payload: json!({}),
        options,
    };
    match queue::send_in(conn, &job).await.unwrap() {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("a send without a key is never a duplicate"),
    }
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn n(conn: &mut AsyncPgConnection, sql: &str) -> i64 {
    diesel::sql_query(sql)
        .get_result::<N>(conn)
        .await
        .unwrap()
        .n
}

#[tokio::test]
async fn a_fetch_appends_claims_and_writes_no_version_of_the_jobs_rows() {
    const JOBS: i64 = 50;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for _ in 0..JOBS {
        send(&mut conn, "c", SendOptions::default()).await;
    }
    let updated = stat_around(
        &mut conn,
        "pg_stat_get_xact_tuples_updated('jobs'::regclass)",
        format!("SELECT * FROM idemstage_fetch(ARRAY['c'], {JOBS}::int)"),
    )
    .await;
    assert_eq!(updated, 0, "the fetch wrote versions of the jobs' rows");
    assert_eq!(
        n(&mut conn, "SELECT count(*) AS n FROM job_claims").await,
        JOBS
    );
    assert_eq!(
        n(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE state = 'active' AND attempt = 1"
        )
        .await,
        JOBS
    );
    // The completion ends each claim with one version of its job's row.
    let completed = stat_around(
        &mut conn,
        "pg_stat_get_xact_tuples_updated('jobs'::regclass)",
        "UPDATE jobs j SET state = 'completed', completed_at = now(), attempt = k.attempt
           FROM job_claims k WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id
            AND j.state IN ('created', 'retry')"
            .to_owned(),
    )
    .await;
    assert_eq!(completed, JOBS);
}

#[derive(diesel::QueryableByName)]
struct Deadline {
    #[diesel(sql_type = Timestamptz)]
    at: DateTime<Utc>,
}

#[derive(diesel::QueryableByName)]
struct State {
    #[diesel(sql_type = Text)]
    state: String,
}

fn ran(outcome: MaintenanceOutcome) -> queue::MaintenanceReport {
    match outcome {
        MaintenanceOutcome::Ran(report) => report,
        MaintenanceOutcome::Skipped => panic!("no other session holds the maintenance lock"),
    }
}

/// A fetch in a transaction that commits only after maintenance has looked at
/// the claims whose deadline passed (its claim was invisible to that run, and
/// its deadline is behind the mark the run set): the next run takes it back.
#[tokio::test]
async fn a_claim_committed_after_expiry_passed_its_deadline_is_taken_back() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut holder = db.conn().await;
    let id = send(
        &mut conn,
        "late",
        SendOptions::default().with_expire_in(Duration::from_millis(1)),
    )
    .await;

    holder.batch_execute("BEGIN").await.unwrap();
    let fetched = queue::fetch(&mut holder, &["late".to_owned()], 1)
        .await
        .unwrap();
    assert_eq!(fetched.len(), 1);
    let deadline: Deadline =
        diesel::sql_query("SELECT lease_expires_at AS at FROM job_claims WHERE job_id = $1")
            .bind::<Text, _>(id.to_string())
            .get_result(&mut holder)
            .await
            .unwrap();
    // The database's clock past the deadline.
    while n(
        &mut conn,
        &format!(
            "SELECT (clock_timestamp() <= '{}'::timestamptz)::int::bigint AS n",
            deadline.at.to_rfc3339()
        ),
    )
    .await
        == 1
    {}

    let config = MaintenanceConfig::default();
    let first = ran(queue::maintain(&mut conn, &config).await.unwrap());
    assert_eq!(first.expired_retried, 0, "the claim is not committed yet");
    holder.batch_execute("COMMIT").await.unwrap();

    let second = ran(queue::maintain(&mut conn, &config).await.unwrap());
    assert_eq!(
        second.expired_retried, 1,
        "the late claim was not taken back"
    );
    let state: State = diesel::sql_query("SELECT state FROM job_states WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(state.state, "retry");
    // Its holder's token is fenced.
    assert_eq!(
        queue::complete(&mut conn, id, fetched[0].attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Fenced
    );
}

#[derive(diesel::QueryableByName)]
struct Options {
    #[diesel(sql_type = diesel::sql_types::Array<Text>)]
    options: Vec<String>,
}

/// Inserts and ANALYZE do not start autovacuum on `job_claims` every few
/// hundred rows (an ANALYZE's snapshot keeps the fetch's spent entries from
/// being marked dead: migration `2026-12-05-100000_claims_analyzed_rarely`).
#[tokio::test]
async fn claims_are_analyzed_and_vacuumed_for_inserts_only_every_100000_rows() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let row: Options = diesel::sql_query(
        "SELECT coalesce(reloptions, '{}') AS options FROM pg_class WHERE relname = 'job_claims'",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    for want in [
        "autovacuum_vacuum_insert_threshold=100000",
        "autovacuum_analyze_threshold=100000",
    ] {
        assert!(row.options.iter().any(|o| o == want), "{:?}", row.options);
    }
}

/// The fenced statements read a job's claim by its key whatever plan the
/// session keeps. Planned while the claims were few and never analyzed (a new
/// install, a benchmark's reset) beside a backlog of jobs, the batched
/// completion joined the claims and hashed the whole table on every call once
/// it had grown: a 100,000-job drain at a third of its speed (BENCHMARKS.md
/// "2026-12-05 02:30").
#[tokio::test]
async fn a_completion_planned_while_claims_were_few_reads_a_grown_table_by_its_key() {
    const BACKLOG: i64 = 3_000;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // A backlog, analyzed; no claim yet.
    conn.batch_execute(&format!(
        "INSERT INTO jobs (id, queue, payload) \
         SELECT lpad(g::text, 26, '0'), 'c', '{{}}' FROM generate_series(1, {BACKLOG}) g;
         ANALYZE jobs"
    ))
    .await
    .unwrap();
    // The plan made on the first call is kept, as a connection's generic plan is.
    conn.batch_execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    let early = queue::fetch(&mut conn, &["c".to_owned()], 2).await.unwrap();
    let tokens: Vec<(JobId, i32)> = early.iter().map(|j| (j.id, j.attempt)).collect();
    assert_eq!(
        queue::complete_many(&mut conn, &tokens[..1]).await.unwrap(),
        vec![JobCompleteOutcome::Completed]
    );
    // The claims grow; no ANALYZE comes.
    assert_eq!(
        n(
            &mut conn,
            &format!("SELECT count(*) AS n FROM idemstage_fetch(ARRAY['c'], {BACKLOG}::int)")
        )
        .await,
        BACKLOG - 2
    );
    // Rows of `job_claims` read by sequential scans, in the completion's
    // transaction.
    let (scanned, outcome) = conn
        .transaction::<_, diesel::result::Error, _>(async |conn| {
            let read = "SELECT pg_stat_get_xact_tuples_returned('job_claims'::regclass) AS n";
            let before = n(conn, read).await;
            let outcome = queue::complete_many(conn, &tokens[1..]).await.unwrap();
            Ok((n(conn, read).await - before, outcome))
        })
        .await
        .unwrap();
    assert_eq!(outcome, vec![JobCompleteOutcome::Completed]);
    assert!(
        scanned < 100,
        "a completion read {scanned} claims by sequential scans (of {BACKLOG} there)"
    );
}

/// A fetch passes the claims in flight once: the lanes' heads are read past
/// them, and the fetch walks on from those heads, not from the floors again
/// (migration `2026-12-05-110000_fetch_walks_from_head`).
#[tokio::test]
async fn a_fetch_walks_past_the_claims_in_flight_once() {
    const IN_FLIGHT: i64 = 100;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for _ in 0..=IN_FLIGHT {
        send(&mut conn, "c", SendOptions::default()).await;
    }
    assert_eq!(
        n(
            &mut conn,
            &format!("SELECT count(*) AS n FROM idemstage_fetch(ARRAY['c'], {IN_FLIGHT}::int)")
        )
        .await,
        IN_FLIGHT
    );
    // Rows of `jobs` read through the ready index by a fetch of the last one.
    let fetched = stat_around(
        &mut conn,
        "pg_stat_get_xact_tuples_fetched('jobs_ready_idx'::regclass)",
        "SELECT * FROM idemstage_fetch(ARRAY['c'], 1)".to_owned(),
    )
    .await;
    assert!(
        fetched < IN_FLIGHT * 3 / 2,
        "a fetch read {fetched} jobs through the ready index past {IN_FLIGHT} claims in flight"
    );
    assert_eq!(
        n(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE state = 'active'"
        )
        .await,
        IN_FLIGHT + 1
    );
}

/// A job is active through its claim only: a row written `active` (or with a
/// lease of its own) by hand would have no claim, and nothing would ever fetch,
/// expire or end it (migration `2026-12-05-120000_no_active_rows`).
#[tokio::test]
async fn a_jobs_row_is_never_active_or_leased_itself() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = send(&mut conn, "c", SendOptions::default()).await;
    for (change, constraint) in [
        ("state = 'active'", "jobs_state_check"),
        ("lease_expires_at = now()", "jobs_no_lease"),
    ] {
        let err = conn
            .batch_execute(&format!("UPDATE jobs SET {change} WHERE id = '{id}'"))
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains(constraint),
            "{change}: refused by {constraint}, got {err}"
        );
    }
    assert_eq!(
        n(
            &mut conn,
            "SELECT count(*) AS n FROM job_states WHERE state = 'created' AND lease_expires_at IS NULL"
        )
        .await,
        1
    );
}

/// Expiry's mark keeps its one row: without it caps counted no open claim and
/// expiry never moved it (migration `2026-12-05-130000_expiry_mark_kept`).
#[tokio::test]
async fn the_expiry_mark_keeps_its_one_row() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for statement in ["DELETE FROM job_expiry_mark", "TRUNCATE job_expiry_mark"] {
        let err = conn.batch_execute(statement).await.unwrap_err();
        assert!(
            err.to_string().contains("keeps its one row"),
            "{statement}: {err}"
        );
    }
    let err = conn
        .batch_execute("INSERT INTO job_expiry_mark (expired_to, xid_horizon) VALUES (now(), 0)")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("job_expiry_mark_pkey"), "{err}");
    assert_eq!(
        n(&mut conn, "SELECT count(*) AS n FROM job_expiry_mark").await,
        1
    );
}
