//! The singleton rules in `job_keys` and `job_windows` (migrations
//! `2026-12-05-233000_keys_kept_between_jobs`,
//! `2026-12-06-000000_key_liveness_from_its_job`): one live job per (queue,
//! key), one job per (queue, key, window) while the job is kept. A key's row
//! names its last job and is held while that job is live, so every end of a
//! job for good (completed, failed, cancelled, expired and failed) releases
//! the key by what it writes of the job, and the row stays for the key's next
//! job; a retry keeps it; a job made live again by any writer takes the key
//! back; a job's row deleted takes its key's row along. The tenant scope
//! writes no key row by hand.

use std::time::Duration;

use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{
    FailKind, JobCancelOutcome, JobFailOutcome, JobId, JobToSend, SendOptions, SendResult, TenantId,
};
use idemstage_persistence::queue::{self, MaintenanceConfig, MaintenanceOutcome};
use idemstage_persistence::{tenant, TxError};
use idemstage_testkit::TestDb;
use serde_json::json;

fn job(key: &str, options: SendOptions) -> JobToSend {
    JobToSend {
        tenant: None,
        queue: "s".to_owned(),
        payload: json!({}),
        options: options.with_singleton_key(key),
    }
}

async fn sent(conn: &mut AsyncPgConnection, job: &JobToSend) -> Option<JobId> {
    match queue::send_in(conn, job).await.unwrap() {
        SendResult::Sent(id) => Some(id),
        SendResult::Duplicate => None,
    }
}

async fn fetch_one(conn: &mut AsyncPgConnection) -> (JobId, i32) {
    let jobs = queue::fetch(conn, &["s".to_owned()], 1).await.unwrap();
    assert_eq!(jobs.len(), 1, "no job fetched");
    (jobs[0].id, jobs[0].attempt)
}

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Rows of `job_keys` for the key: `(all, live)` (at most one row).
async fn key_rows(conn: &mut AsyncPgConnection, key: &str) -> (i64, i64) {
    let all: N = diesel::sql_query(
        "SELECT count(*) AS n FROM job_keys WHERE queue = 's' AND singleton_key = $1",
    )
    .bind::<Text, _>(key)
    .get_result(conn)
    .await
    .unwrap();
    let live: N = diesel::sql_query(
        "SELECT count(*) AS n FROM job_keys
          WHERE queue = 's' AND singleton_key = $1
            AND idemstage_key_holder_live(job_id)",
    )
    .bind::<Text, _>(key)
    .get_result(conn)
    .await
    .unwrap();
    (all.n, live.n)
}

/// Rows of `job_windows` for the key.
async fn window_rows(conn: &mut AsyncPgConnection, key: &str) -> i64 {
    let n: N = diesel::sql_query(
        "SELECT count(*) AS n FROM job_windows WHERE queue = 's' AND singleton_key = $1",
    )
    .bind::<Text, _>(key)
    .get_result(conn)
    .await
    .unwrap();
    n.n
}

#[tokio::test]
async fn every_end_for_good_releases_the_key_and_a_retry_keeps_it() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let no_retry = SendOptions::default().with_retry_limit(0);

    // Completed.
    let first = sent(&mut conn, &job("done", SendOptions::default()))
        .await
        .unwrap();
    assert_eq!(
        sent(&mut conn, &job("done", SendOptions::default())).await,
        None
    );
    let (id, attempt) = fetch_one(&mut conn).await;
    assert_eq!(id, first);
    assert_eq!(
        sent(&mut conn, &job("done", SendOptions::default())).await,
        None
    );
    queue::complete(&mut conn, id, attempt, None).await.unwrap();
    assert_eq!(key_rows(&mut conn, "done").await, (1, 0));
    let next = sent(&mut conn, &job("done", SendOptions::default())).await;
    assert!(next.is_some(), "the completed job kept its key");
    let (id, attempt) = fetch_one(&mut conn).await;
    queue::complete(&mut conn, id, attempt, None).await.unwrap();

    // A retry keeps the key; the failure for good releases it.
    let failing = sent(
        &mut conn,
        &job("fail", SendOptions::default().with_retry_limit(1)),
    )
    .await
    .unwrap();
    let (id, attempt) = fetch_one(&mut conn).await;
    assert_eq!(id, failing);
    assert!(matches!(
        queue::fail(&mut conn, id, attempt, "once", FailKind::Transient)
            .await
            .unwrap(),
        JobFailOutcome::Retrying { .. }
    ));
    assert_eq!(key_rows(&mut conn, "fail").await, (1, 1));
    assert_eq!(sent(&mut conn, &job("fail", no_retry.clone())).await, None);
    diesel::sql_query("UPDATE jobs SET start_after = now() WHERE id = $1")
        .bind::<Text, _>(failing.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    let (id, attempt) = fetch_one(&mut conn).await;
    assert_eq!(id, failing);
    assert!(matches!(
        queue::fail(&mut conn, id, attempt, "twice", FailKind::Transient)
            .await
            .unwrap(),
        JobFailOutcome::Failed { .. }
    ));
    assert_eq!(key_rows(&mut conn, "fail").await, (1, 0));

    // Cancelled.
    sent(&mut conn, &job("cancel", no_retry.clone()))
        .await
        .unwrap();
    let (id, attempt) = fetch_one(&mut conn).await;
    assert_eq!(
        queue::cancel(&mut conn, id, attempt).await.unwrap(),
        JobCancelOutcome::Cancelled
    );
    assert_eq!(key_rows(&mut conn, "cancel").await, (1, 0));
    // A second cancel of the attempt is fenced and touches no key.
    sent(&mut conn, &job("cancel", no_retry.clone()))
        .await
        .unwrap();
    assert_eq!(
        queue::cancel(&mut conn, id, attempt).await.unwrap(),
        JobCancelOutcome::Fenced
    );
    assert_eq!(key_rows(&mut conn, "cancel").await, (1, 1));
    let (id, attempt) = fetch_one(&mut conn).await;
    queue::complete(&mut conn, id, attempt, None).await.unwrap();

    // Expired with no retry left.
    sent(&mut conn, &job("expire", no_retry)).await.unwrap();
    let (id, _) = fetch_one(&mut conn).await;
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
    assert_eq!(report.expired_failed, 1);
    assert_eq!(key_rows(&mut conn, "expire").await, (1, 0));

    // Nothing live is left; each key kept one row for its next job.
    let left: N = diesel::sql_query(
        "SELECT count(*) AS n FROM job_keys WHERE idemstage_key_holder_live(job_id)",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(left.n, 0);
    let kept: N = diesel::sql_query("SELECT count(*) AS n FROM job_keys")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(kept.n, 4);
}

#[tokio::test]
async fn a_batch_releases_the_keys_of_the_jobs_it_completed_only() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let batch = [
        job("a", SendOptions::default()),
        job("a", SendOptions::default()),
        job("b", SendOptions::default()),
    ];
    let results = queue::send_batch(&mut conn, &batch).await.unwrap();
    assert!(matches!(results[0], SendResult::Sent(_)));
    assert_eq!(results[1], SendResult::Duplicate);
    assert!(matches!(results[2], SendResult::Sent(_)));
    let jobs = queue::fetch(&mut conn, &["s".to_owned()], 2).await.unwrap();
    assert_eq!(jobs.len(), 2);
    let first: Vec<(JobId, i32)> = jobs[..1].iter().map(|j| (j.id, j.attempt)).collect();
    queue::complete_many(&mut conn, &first).await.unwrap();
    let done = jobs[0].singleton_key.clone().unwrap();
    let other = if done == "a" { "b" } else { "a" };
    assert_eq!(key_rows(&mut conn, &done).await, (1, 0));
    assert_eq!(key_rows(&mut conn, other).await, (1, 1));
}

#[tokio::test]
async fn a_windowed_key_refuses_its_window_after_its_job_ended_until_the_retention() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let hourly = || job("w", SendOptions::default().with_singleton_seconds(3600));
    sent(&mut conn, &hourly()).await.unwrap();
    let (id, attempt) = fetch_one(&mut conn).await;
    queue::complete(&mut conn, id, attempt, None).await.unwrap();
    assert_eq!(key_rows(&mut conn, "w").await, (1, 0));
    assert_eq!(window_rows(&mut conn, "w").await, 1, "the window is kept");
    assert_eq!(
        sent(&mut conn, &hourly()).await,
        None,
        "a second job in the window"
    );
    // The live rule alone does not refuse it: a send without a window goes.
    let unwindowed = sent(&mut conn, &job("w", SendOptions::default())).await;
    assert!(unwindowed.is_some());
    let (id, attempt) = fetch_one(&mut conn).await;
    queue::complete(&mut conn, id, attempt, None).await.unwrap();

    // Past the retention the window goes with its job's row.
    diesel::sql_query("UPDATE job_closures SET closed_at = now() - interval '2 days'")
        .execute(&mut conn)
        .await
        .unwrap();
    let config = MaintenanceConfig::default().with_retention(Duration::from_secs(24 * 3600));
    assert!(matches!(
        queue::maintain(&mut conn, &config).await.unwrap(),
        MaintenanceOutcome::Ran(_)
    ));
    assert_eq!(key_rows(&mut conn, "w").await, (0, 0));
    assert_eq!(window_rows(&mut conn, "w").await, 0);
    assert!(sent(&mut conn, &hourly()).await.is_some());
}

/// A job's row deleted by hand takes its key along: the key's next job can be
/// sent (before, a key could outlive its job and refuse every send for good).
#[tokio::test]
async fn a_job_deleted_by_hand_releases_its_key() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let id = sent(&mut conn, &job("gone", SendOptions::default()))
        .await
        .unwrap();
    diesel::sql_query("DELETE FROM jobs WHERE id = $1")
        .bind::<Text, _>(id.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(key_rows(&mut conn, "gone").await, (0, 0));
    assert!(sent(&mut conn, &job("gone", SendOptions::default()))
        .await
        .is_some());
}

/// Any writer's UPDATE of a keyed job's state across live and ended moves its
/// key along (`jobs`' trigger): ended by hand, the key is free; made live
/// again, the job takes its key back, and a second live job of the key is
/// refused (a unique violation, as with the index on `jobs` before).
#[tokio::test]
async fn a_state_written_by_hand_moves_the_key_along() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let first = sent(&mut conn, &job("hand", SendOptions::default()))
        .await
        .unwrap();
    let set_state = |state: &str, id: JobId| {
        diesel::sql_query(format!(
            "UPDATE jobs SET state = '{state}', completed_at = now() WHERE id = '{id}'"
        ))
    };
    set_state("completed", first)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(key_rows(&mut conn, "hand").await, (1, 0));
    let second = sent(&mut conn, &job("hand", SendOptions::default()))
        .await
        .expect("the key of a job completed by hand was kept");
    // The first made live again while the second is: refused, nothing changed.
    let e = set_state("retry", first)
        .execute(&mut conn)
        .await
        .expect_err("two live jobs of one key");
    assert!(e.to_string().contains("job_keys_pkey"), "{e}");
    set_state("cancelled", second)
        .execute(&mut conn)
        .await
        .unwrap();
    set_state("retry", first).execute(&mut conn).await.unwrap();
    assert_eq!(key_rows(&mut conn, "hand").await, (1, 1));
    assert_eq!(
        sent(&mut conn, &job("hand", SendOptions::default())).await,
        None
    );
}

/// A job row written by hand (a team's script, not the library's send) takes
/// its key too (`jobs`' insert trigger): one of a live key is not inserted,
/// and one of a free key holds it against the library's next send.
#[tokio::test]
async fn a_job_row_written_by_hand_takes_its_key() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    sent(&mut conn, &job("by-hand", SendOptions::default()))
        .await
        .unwrap();
    let insert = |id: JobId, key: &str| {
        diesel::sql_query(format!(
            "INSERT INTO jobs (id, queue, payload, singleton_key, tenant_id) \
             VALUES ('{id}', 's', '{{}}'::jsonb, '{key}', '')"
        ))
    };
    let inserted = insert(JobId::new(), "by-hand")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(inserted, 0, "a second live job of the key was written");
    assert_eq!(key_rows(&mut conn, "by-hand").await, (1, 1));

    let own = JobId::new();
    assert_eq!(insert(own, "free").execute(&mut conn).await.unwrap(), 1);
    assert_eq!(key_rows(&mut conn, "free").await, (1, 1));
    assert_eq!(
        sent(&mut conn, &job("free", SendOptions::default())).await,
        None
    );
}

/// A job's key rewritten by hand (`UPDATE jobs SET singleton_key`, or its
/// queue) moves its key's row along: the old key is free, the new one held, and
/// a rewrite onto a key another live job holds is refused, as the unique index
/// on `jobs` refused it before the key rows had a table of their own.
#[tokio::test]
async fn a_key_rewritten_by_hand_moves_its_row_and_cannot_take_a_held_key() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let a = sent(&mut conn, &job("a", SendOptions::default()))
        .await
        .unwrap();
    sent(&mut conn, &job("held", SendOptions::default()))
        .await
        .unwrap();
    let rekey = |id: JobId, key: &str| {
        diesel::sql_query(format!(
            "UPDATE jobs SET singleton_key = '{key}' WHERE id = '{id}'"
        ))
    };
    let e = rekey(a, "held")
        .execute(&mut conn)
        .await
        .expect_err("two live jobs of one key");
    assert!(e.to_string().contains("job_keys_pkey"), "{e}");
    assert_eq!(key_rows(&mut conn, "a").await, (1, 1));

    rekey(a, "b").execute(&mut conn).await.unwrap();
    assert_eq!(key_rows(&mut conn, "a").await, (0, 0));
    assert_eq!(key_rows(&mut conn, "b").await, (1, 1));
    assert_eq!(
        sent(&mut conn, &job("b", SendOptions::default())).await,
        None,
        "a second live job of the rewritten key"
    );
    assert!(
        sent(&mut conn, &job("a", SendOptions::default()))
            .await
            .is_some(),
        "the old key stayed taken"
    );
    // Its key taken away: the job holds none.
    diesel::sql_query(format!(
        "UPDATE jobs SET singleton_key = NULL WHERE id = '{a}'"
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(key_rows(&mut conn, "b").await, (0, 0));
}

/// The tenant scope writes no key row by hand: its jobs take their keys
/// through `jobs`' insert trigger (which checks a stage key against the job's
/// tenant), so a scoped transaction cannot hold another tenant's stage key by
/// a row of its own (which would refuse that tenant's stage job as a
/// duplicate for good), nor delete or rename a key row, nor point an ended
/// key at a live job of its own, nor release its own live key by pointing it
/// at a job that ended. It may lock its key's row (a repoint).
#[tokio::test]
async fn a_transaction_scoped_to_one_tenant_writes_no_key_row_by_hand() {
    let db = TestDb::new().await;
    let a = TenantId::parse("ta").unwrap();
    let mut w = idemstage_persistence::connect(&db.worker_url())
        .await
        .unwrap();
    let item = idemstage_domain::ItemId::new();
    let theirs = format!("intake:tb:{item}");
    let mut own = job("invoice-42", SendOptions::default());
    own.tenant = Some(a.clone());
    tenant::transaction::<(), TxError, _>(&mut w, &a, async |c| {
        assert!(matches!(
            queue::send_in(c, &own).await?,
            SendResult::Sent(_)
        ));
        Ok(
            c.batch_execute("SELECT 1 FROM job_keys WHERE singleton_key = 'invoice-42' FOR UPDATE")
                .await?,
        )
    })
    .await
    .unwrap();
    let by_hand = [
        format!(
            "INSERT INTO job_keys (queue, singleton_key, job_id, tenant_id) \
             VALUES ('s', '{theirs}', '{}', 'ta')",
            JobId::new()
        ),
        format!(
            "UPDATE job_keys SET singleton_key = '{theirs}' WHERE singleton_key = 'invoice-42'"
        ),
        "DELETE FROM job_keys WHERE singleton_key = 'invoice-42'".to_owned(),
    ];
    for sql in &by_hand {
        let e = tenant::transaction::<(), diesel::result::Error, _>(&mut w, &a, async |c| {
            c.batch_execute(sql).await
        })
        .await
        .expect_err(sql);
        assert!(e.to_string().contains("permission denied"), "{sql}: {e}");
    }
    let mut conn = db.conn().await;
    assert_eq!(key_rows(&mut conn, "invoice-42").await, (1, 1));

    // The key's row names its job; the scope may not point it elsewhere: at
    // a job that ended (its live key released by hand, a second live job of
    // the key then sent), nor, once the job is done, at a live job of its own
    // (the key held for it: every later send of the key, another tenant's
    // too, refused).
    let (id, attempt) = fetch_one(&mut conn).await;
    let repoint = "UPDATE job_keys SET job_id = '00000000000000000000000000' \
                   WHERE singleton_key = 'invoice-42'";
    let e = tenant::transaction::<(), diesel::result::Error, _>(&mut w, &a, async |c| {
        c.batch_execute(repoint).await
    })
    .await
    .expect_err("a live key released by hand");
    assert!(e.to_string().contains("row-level security"), "{e}");
    queue::complete(&mut conn, id, attempt, None).await.unwrap();
    let e = tenant::transaction::<(), diesel::result::Error, _>(&mut w, &a, async |c| {
        c.batch_execute(repoint).await
    })
    .await
    .expect_err("an ended key pointed elsewhere by hand");
    assert!(e.to_string().contains("row-level security"), "{e}");
    assert_eq!(key_rows(&mut conn, "invoice-42").await, (1, 0));
    let mut theirs = job("invoice-42", SendOptions::default());
    theirs.tenant = Some(TenantId::parse("tb").unwrap());
    assert!(sent(&mut conn, &theirs).await.is_some());
}

/// A key's job ending writes nothing to the key's row (the key is held
/// while the job the row names is live), and the key's next job takes the
/// row over by one version that a page read prunes (a HOT update); nothing
/// is deleted: a keyed job (every stage job) leaves no dead tuple in the key
/// table at its end. Before, the end wrote the row (and, before that,
/// deleted it).
#[tokio::test]
async fn a_key_is_released_without_a_write_and_taken_over_by_a_hot_update() {
    use diesel_async::AsyncConnection;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    #[derive(diesel::QueryableByName)]
    struct Writes {
        #[diesel(sql_type = BigInt)]
        deleted: i64,
        #[diesel(sql_type = BigInt)]
        updated: i64,
        #[diesel(sql_type = BigInt)]
        hot: i64,
    }
    let keys: Vec<String> = (0..20).map(|k| format!("k{k}")).collect();
    let writes = conn
        .transaction::<_, TxError, _>(async |conn| {
            for round in 0..2 {
                for key in &keys {
                    assert!(sent(conn, &job(key, SendOptions::default()))
                        .await
                        .is_some());
                }
                let jobs = queue::fetch(conn, &["s".to_owned()], 20).await?;
                assert_eq!(jobs.len(), 20, "round {round}");
                let tokens: Vec<(JobId, i32)> = jobs.iter().map(|j| (j.id, j.attempt)).collect();
                queue::complete_many(conn, &tokens).await?;
            }
            // pg_stat_xact_user_tables counts this transaction's writes.
            Ok(diesel::sql_query(
                "SELECT coalesce(sum(n_tup_del), 0)::bigint AS deleted,
                        coalesce(sum(n_tup_upd), 0)::bigint AS updated,
                        coalesce(sum(n_tup_hot_upd), 0)::bigint AS hot
                   FROM pg_stat_xact_user_tables
                  WHERE relname IN ('job_keys', 'job_windows', 'job_singletons')",
            )
            .get_result::<Writes>(conn)
            .await?)
        })
        .await
        .unwrap();
    assert_eq!(writes.deleted, 0, "key rows deleted");
    // Taken over once per key; the two completions wrote nothing.
    assert_eq!(writes.updated, 20, "key rows written by the ends");
    assert_eq!(writes.hot, 20, "key row updates that were not HOT");
}
