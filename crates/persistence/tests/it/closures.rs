//! A job is completed by a closure appended to `job_closures` beside its row
//! (migration `2026-12-05-150000_job_closures`; a job with a singleton key, as
//! every stage job, since `2026-12-05-170000_job_singletons`; its key is kept
//! in `job_keys` since `2026-12-05-233000_keys_kept_between_jobs`): the completion
//! writes no version of the job's row, and everything that asks whether a claim
//! is still open (expiry, caps, renewals, the other ends of the same attempt,
//! retention) reads the closure.

use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    FailKind, JobCompleteOutcome, JobFailOutcome, JobId, JobRetryOutcome, JobToSend, SendOptions,
    SendResult,
};
use idemstage_persistence::queue::{
    self, Limits, MaintenanceConfig, MaintenanceOutcome, RenewLeaseOutcome, Scope,
};
use idemstage_testkit::TestDb;
use serde_json::json;

use crate::controls::test_actor;

async fn send(conn: &mut AsyncPgConnection, queue_name: &str, key: Option<&str>) -> JobId {
    let options = match key {
        Some(key) => SendOptions::default().with_singleton_key(key),
        None => SendOptions::default(),
    };
    let job = JobToSend {
        tenant: None,
        queue: queue_name.to_owned(),
        payload: json!({}),
        options,
    };
    match queue::send_in(conn, &job).await.unwrap() {
        SendResult::Sent(id) => id,
        SendResult::Duplicate => panic!("a duplicate"),
    }
}

async fn fetch_one(conn: &mut AsyncPgConnection, queue_name: &str) -> (JobId, i32) {
    let jobs = queue::fetch(conn, &[queue_name.to_owned()], 1)
        .await
        .unwrap();
    assert_eq!(jobs.len(), 1, "no job fetched from {queue_name}");
    (jobs[0].id, jobs[0].attempt)
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

async fn n(conn: &mut AsyncPgConnection, sql: &str, id: JobId) -> i64 {
    diesel::sql_query(sql)
        .bind::<Text, _>(id.to_string())
        .get_result::<N>(conn)
        .await
        .unwrap()
        .n
}

#[derive(diesel::QueryableByName)]
struct Version {
    #[diesel(sql_type = Text)]
    v: String,
}

/// The row version of the job: changes with every write of the row.
async fn version(conn: &mut AsyncPgConnection, id: JobId) -> String {
    diesel::sql_query("SELECT ctid::text || '/' || xmin::text AS v FROM jobs WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .get_result::<Version>(conn)
        .await
        .unwrap()
        .v
}

#[derive(diesel::QueryableByName)]
struct Shown {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Jsonb>)]
    output: Option<serde_json::Value>,
    #[diesel(sql_type = diesel::sql_types::Bool)]
    has_completed_at: bool,
}

async fn shown(conn: &mut AsyncPgConnection, id: JobId) -> Shown {
    diesel::sql_query(
        "SELECT state, output, completed_at IS NOT NULL AS has_completed_at
           FROM job_states WHERE id = $1",
    )
    .bind::<Text, _>(id.to_string())
    .get_result(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_completion_without_a_singleton_key_appends_a_closure_and_leaves_the_row() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let plain = send(&mut conn, "c", None).await;
    let (id, attempt) = fetch_one(&mut conn, "c").await;
    assert_eq!(id, plain);
    let before = version(&mut conn, plain).await;
    let output = json!({"sum": 3});
    assert_eq!(
        queue::complete(&mut conn, plain, attempt, Some(&output))
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
    assert_eq!(
        version(&mut conn, plain).await,
        before,
        "the row was written"
    );
    let s = shown(&mut conn, plain).await;
    assert_eq!(
        (s.state.as_str(), s.output, s.has_completed_at),
        ("completed", Some(output), true)
    );
    // Ended once: a second completion and a failure of the attempt are fenced.
    assert_eq!(
        queue::complete(&mut conn, plain, attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Fenced
    );
    assert_eq!(
        queue::fail(&mut conn, plain, attempt, "late", FailKind::Transient)
            .await
            .unwrap(),
        JobFailOutcome::Fenced
    );
    assert_eq!(
        queue::retry_now(&mut conn, plain, attempt).await.unwrap(),
        JobRetryOutcome::Fenced
    );
    assert_eq!(
        queue::renew_lease(&mut conn, plain, attempt).await.unwrap(),
        RenewLeaseOutcome::Fenced
    );
    assert_eq!(version(&mut conn, plain).await, before);
    assert_eq!(shown(&mut conn, plain).await.state, "completed");
    // Nothing fetches it again.
    assert!(queue::fetch(&mut conn, &["c".to_owned()], 10)
        .await
        .unwrap()
        .is_empty());

    // With a singleton key too: the row is not written, and the key is free
    // again.
    let keyed = send(&mut conn, "c", Some("k")).await;
    let (id, attempt) = fetch_one(&mut conn, "c").await;
    assert_eq!(id, keyed);
    let before = version(&mut conn, keyed).await;
    assert_eq!(
        queue::complete(&mut conn, keyed, attempt, None)
            .await
            .unwrap(),
        JobCompleteOutcome::Completed
    );
    assert_eq!(
        version(&mut conn, keyed).await,
        before,
        "the row was written"
    );
    assert_eq!(shown(&mut conn, keyed).await.state, "completed");
    assert_eq!(
        n(
            &mut conn,
            "SELECT count(*) AS n FROM job_closures WHERE job_id = $1",
            keyed
        )
        .await,
        1
    );
    send(&mut conn, "c", Some("k")).await;
}

#[tokio::test]
async fn a_failure_closes_the_claim_first_so_a_later_completion_is_fenced() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = send(&mut conn, "f", None).await;
    let (_, attempt) = fetch_one(&mut conn, "f").await;
    assert!(matches!(
        queue::fail(&mut conn, id, attempt, "boom", FailKind::Transient)
            .await
            .unwrap(),
        JobFailOutcome::Retrying { .. }
    ));
    assert_eq!(
        queue::complete(&mut conn, id, attempt, None).await.unwrap(),
        JobCompleteOutcome::Fenced
    );
    assert_eq!(shown(&mut conn, id).await.state, "retry");
    assert_eq!(
        n(
            &mut conn,
            "SELECT count(*) AS n FROM job_closures WHERE job_id = $1 AND outcome = 'failed'",
            id
        )
        .await,
        1
    );
}

#[tokio::test]
async fn expiry_leaves_a_job_completed_by_its_closure_alone() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = send(&mut conn, "e", None).await;
    let (_, attempt) = fetch_one(&mut conn, "e").await;
    queue::complete(&mut conn, id, attempt, None).await.unwrap();
    // Its lease runs out after the completion.
    diesel::sql_query(
        "UPDATE job_claims SET lease_expires_at = now() - interval '1 minute' WHERE job_id = $1",
    )
    .bind::<Text, _>(id.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    let MaintenanceOutcome::Ran(report) = queue::maintain(&mut conn, &MaintenanceConfig::default())
        .await
        .unwrap()
    else {
        panic!("skipped");
    };
    assert_eq!(
        (report.expired_retried, report.expired_failed),
        (0, 0),
        "expiry took a completed job back"
    );
    assert_eq!(shown(&mut conn, id).await.state, "completed");
}

#[tokio::test]
async fn a_closed_claim_no_longer_counts_against_a_cap() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let first = send(&mut conn, "cap", None).await;
    let second = send(&mut conn, "cap", None).await;
    let one = Limits {
        max_active: Some(1),
        ..Limits::default()
    };
    queue::set_limits(&mut conn, "cap", &Scope::Queue, &one, &test_actor())
        .await
        .unwrap();
    let (id, attempt) = fetch_one(&mut conn, "cap").await;
    assert_eq!(id, first);
    // The cap is taken: nothing more.
    assert!(queue::fetch(&mut conn, &["cap".to_owned()], 1)
        .await
        .unwrap()
        .is_empty());
    queue::complete(&mut conn, first, attempt, None)
        .await
        .unwrap();
    // Its claim's lease has not run out, but the claim is closed.
    let (id, _) = fetch_one(&mut conn, "cap").await;
    assert_eq!(id, second);
}

#[tokio::test]
async fn retention_deletes_a_closure_with_its_claim_and_row_and_nothing_comes_back() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let old = send(&mut conn, "r", None).await;
    let (_, attempt) = fetch_one(&mut conn, "r").await;
    queue::complete(&mut conn, old, attempt, None)
        .await
        .unwrap();
    diesel::sql_query(
        "UPDATE job_closures SET closed_at = now() - interval '2 days' WHERE job_id = $1",
    )
    .bind::<Text, _>(old.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    // The claim alone past the retention (its deadline): kept while its closure is.
    let fresh = send(&mut conn, "r", None).await;
    let (_, attempt) = fetch_one(&mut conn, "r").await;
    queue::complete(&mut conn, fresh, attempt, None)
        .await
        .unwrap();
    diesel::sql_query(
        "UPDATE job_claims SET lease_expires_at = now() - interval '2 days',
                claimed_at = now() - interval '2 days' WHERE job_id = $1",
    )
    .bind::<Text, _>(fresh.to_string())
    .execute(&mut conn)
    .await
    .unwrap();
    let config = MaintenanceConfig::default().with_retention(Duration::from_secs(24 * 3600));
    let MaintenanceOutcome::Ran(report) = queue::maintain(&mut conn, &config).await.unwrap() else {
        panic!("skipped");
    };
    assert_eq!(report.deleted, 1);
    for (table, column) in [
        ("jobs", "id"),
        ("job_claims", "job_id"),
        ("job_closures", "job_id"),
    ] {
        let sql = format!("SELECT count(*) AS n FROM {table} WHERE {column} = $1");
        assert_eq!(n(&mut conn, &sql, old).await, 0, "{table} kept the old job");
        assert_eq!(
            n(&mut conn, &sql, fresh).await,
            1,
            "{table} lost the fresh job"
        );
    }
    assert_eq!(shown(&mut conn, fresh).await.state, "completed");
    assert!(queue::fetch(&mut conn, &["r".to_owned()], 10)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_batch_completes_jobs_with_and_without_a_singleton_key() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let plain = send(&mut conn, "b", None).await;
    let keyed = send(&mut conn, "b", Some("k")).await;
    let jobs = queue::fetch(&mut conn, &["b".to_owned()], 2).await.unwrap();
    assert_eq!(jobs.len(), 2);
    let tokens: Vec<(JobId, i32)> = jobs.iter().map(|j| (j.id, j.attempt)).collect();
    let outcomes = queue::complete_many(&mut conn, &tokens).await.unwrap();
    assert_eq!(outcomes, vec![JobCompleteOutcome::Completed; 2]);
    for id in [plain, keyed] {
        assert_eq!(shown(&mut conn, id).await.state, "completed");
    }
    let again = queue::complete_many(&mut conn, &tokens).await.unwrap();
    assert_eq!(again, vec![JobCompleteOutcome::Fenced; 2]);
}

/// `(ready, delayed, active)` of the queue.
async fn depth(conn: &mut AsyncPgConnection, queue_name: &str) -> (i64, i64, i64) {
    let d = queue::queue_depths(conn, &[queue_name.to_owned()])
        .await
        .unwrap()
        .remove(0);
    (d.ready, d.delayed, d.active)
}

#[tokio::test]
async fn depth_counts_no_closed_job_and_the_open_claims_below_a_raised_floor() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let running = send(&mut conn, "d", None).await;
    let done = send(&mut conn, "d", None).await;
    let later = JobToSend {
        tenant: None,
        queue: "d".to_owned(),
        payload: json!({}),
        options: SendOptions::default().with_start_after(Duration::from_secs(3600)),
    };
    queue::send_in(&mut conn, &later).await.unwrap();
    let jobs = queue::fetch(&mut conn, &["d".to_owned()], 2).await.unwrap();
    assert_eq!(
        jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
        [running, done]
    );
    queue::complete(&mut conn, done, jobs[1].attempt, None)
        .await
        .unwrap();
    send(&mut conn, "d", None).await;
    assert_eq!(depth(&mut conn, "d").await, (1, 1, 1));
    // The floor rises past the running job's and the completed job's entries
    // (and the deferred job's): the counts stay.
    let first = queue::advance_floors(&mut conn, None, Duration::ZERO)
        .await
        .unwrap();
    queue::advance_floors(&mut conn, first, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        n(
            &mut conn,
            "SELECT count(*) AS n FROM job_lanes l, jobs j
              WHERE j.id = $1 AND l.queue = 'd' AND l.floor > j.ready_seq",
            running
        )
        .await,
        1,
        "the floor did not pass the running job"
    );
    assert_eq!(depth(&mut conn, "d").await, (1, 1, 1));
}
