//! Database errors after a claim: the stage is never left `running` with no live
//! job, and the database's problems do not use up the stage's attempts.

use idemstage_persistence::FencedTx;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use idemstage_domain::{input_hash_of, ItemId, StageError, StagePolicy, TenantId};
use idemstage_persistence::items::register_item;
use idemstage_runner::Counters;
use idemstage_stage::{first_job, Done, Pipeline, PrepareContext, Stage, StageRef};

use crate::support::{
    assert_quiet_and_sound, count, send, start_pipeline_worker, stop_pipeline_worker, text,
};

/// Waits (polling the database, with a deadline) until `sql` returns a row.
async fn wait_for_row(conn: &mut diesel_async::AsyncPgConnection, sql: &str, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(conn, sql).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 55P03 (lock timeout) and 57014 (statement timeout): another session holds the
/// file row the intake stage inserts, so the stage's fenced transaction waits and
/// times out. Both used to be permanent errors: the stage ended `dead` (or, when
/// recording the failure timed out too, `running` with no live job). Now the
/// attempt is released uncounted and the job retried with backoff until the lock
/// is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_and_statement_timeouts_after_a_claim_are_retried_not_lost() {
    for setting in ["lock_timeout", "statement_timeout"] {
        let db = idemstage_harness::example::db().await;
        let mut conn = db.conn().await;
        conn.batch_execute(&format!(
            "ALTER DATABASE \"{}\" SET {setting} = '150ms'",
            db.name()
        ))
        .await
        .unwrap();
        let tenant = TenantId::parse("t1").unwrap();
        let item = ItemId::new();
        let input = text(1);
        send(&mut conn, &tenant, item, &input).await;
        // The row intake's insert-or-get will conflict with, uncommitted: the
        // stage's insert waits for this transaction.
        let mut holder = db.conn().await;
        holder
            .batch_execute(&format!(
                "SET lock_timeout = 0; SET statement_timeout = 0; BEGIN;
                 INSERT INTO dateien (id, tenant_id, item_id, sha256, s3_key, size_bytes)
                 VALUES ('{}', 't1', '{item}', '{}', 'items/t1/{item}/input.txt', 1)",
                idemstage_domain::RowId::new(),
                input_hash_of(input.as_bytes())
            ))
            .await
            .unwrap();
        let worker = start_pipeline_worker(
            db.pool(4).await,
            db.url(),
            crate::support::pipeline(),
            2,
            Arc::new(Counters::default()),
        );
        // Interrupted twice: the first retry met the lock again and was retried too.
        wait_for_row(
            &mut conn,
            "SELECT 1 FROM stage_run_attempts
              WHERE outcome = 'abandoned' AND attempt >= 2",
            &format!("two interrupted intake attempts under {setting}"),
        )
        .await;
        holder.batch_execute("ROLLBACK").await.unwrap();
        let check = assert_quiet_and_sound(db.url(), 120).await;
        stop_pipeline_worker(worker).await;
        assert_eq!(check.failed_jobs, 0, "{setting}: {check:?}");
        assert_eq!(
            count(
                &mut conn,
                "SELECT 1 FROM stage_run_attempts WHERE outcome = 'failed'"
            )
            .await,
            0,
            "{setting}: a database error counted as a failed attempt"
        );
        assert_eq!(
            count(
                &mut conn,
                "SELECT 1 FROM stage_runs WHERE status = 'success'"
            )
            .await,
            4,
            "{setting}"
        );
    }
}

/// Fails its first attempt with an error text that holds a NUL byte.
struct NulOnce {
    policy: StagePolicy,
}

#[async_trait]
impl Stage for NulOnce {
    const NAME: &'static str = "unnamed";
    type Input = ();
    type Prepared = ();
    type Output = ();
    async fn prepare(&self, _: &PrepareContext<'_, ()>) -> Result<(), StageError> {
        Ok(())
    }
    fn policy(&self) -> StagePolicy {
        self.policy.clone()
    }
    async fn commit(&self, tx: &mut FencedTx<'_>, _: &(), _: &()) -> Result<Done<()>, StageError> {
        if tx.token().attempt == 1 {
            return Err(StageError::Transient("upstream said \0 and more".into()));
        }
        Ok(Done::next(()))
    }
}

/// 22021: PostgreSQL's `text` refuses NUL. Recording the failure used to fail with
/// it, the job failed for good and the stage stayed `running` with no live job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_byte_in_a_stage_error_is_recorded_and_the_stage_retried() {
    let db = idemstage_harness::example::db().await;
    let mut conn = db.conn().await;
    let pipeline = Pipeline::new(vec![StageRef::named(
        "nul",
        NulOnce {
            policy: StagePolicy::default(),
        },
    )
    .unwrap()])
    .unwrap();
    let tenant = TenantId::parse("t1").unwrap();
    let item = ItemId::new();
    register_item(&mut conn, &tenant, &item, "x").await.unwrap();
    let job = first_job(&pipeline, tenant, item, input_hash_of(b"x"));
    idemstage_persistence::queue::send_in(&mut conn, &job)
        .await
        .unwrap();
    let worker = start_pipeline_worker(
        db.pool(4).await,
        db.url(),
        pipeline,
        2,
        Arc::new(Counters::default()),
    );
    wait_for_row(
        &mut conn,
        "SELECT 1 FROM stage_runs WHERE stage = 'nul' AND status = 'success'",
        "the stage succeeds on its second attempt",
    )
    .await;
    stop_pipeline_worker(worker).await;
    #[derive(diesel::QueryableByName)]
    struct Error {
        #[diesel(sql_type = diesel::sql_types::Text)]
        error: String,
    }
    let recorded: Error = diesel::sql_query(
        "SELECT error FROM stage_run_attempts WHERE attempt = 1 AND outcome = 'failed'",
    )
    .get_result(&mut conn)
    .await
    .unwrap();
    assert!(
        recorded.error.contains("upstream said \u{fffd} and more"),
        "{}",
        recorded.error
    );
    assert_eq!(
        count(&mut conn, "SELECT 1 FROM job_states WHERE state = 'failed'").await,
        0
    );
}
