//! Ending (or extending) a fetched job's lease. A lease is a claim in
//! `job_claims`, beside the job's row; every statement here is fenced on the
//! claim of `(id, attempt)` being the job's current one ([`claim_fence_sql`]):
//! zero rows means the lease was taken over (expired and retried by
//! maintenance, or fetched again), or ended already, and the caller gets
//! `Fenced`. A lease that ran out but was not yet taken over can still be ended:
//! nobody else holds the job.
//!
//! Every end appends a closure first (`job_closures`, keyed by the claim's
//! `ready_seq`, [`closure_cte`]): a completion writes nothing else in `jobs`,
//! the other ends write the row only when their closure was inserted, so two
//! ends of one attempt meet on the closure's key. An end writes nothing to the
//! job's singleton key: its row in `job_keys` names the job, and the key is
//! held while that job is live (`idemstage_key_holder_live`), so the key's
//! next job can be sent once the end is committed.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use diesel::sql_types::{Bool, Integer, Jsonb, Nullable, Text, Timestamptz};
use diesel::OptionalExtension;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    FailKind, JobCancelOutcome, JobCompleteOutcome, JobFailOutcome, JobId, JobRetryOutcome,
    RepoError,
};

use super::{RETRY_DELAY_MS_SQL, VALID_QUEUE_SQL};
use crate::cached::CachedExt;
use crate::error::map_diesel_error;

#[derive(diesel::QueryableByName)]
struct IdRow {
    #[diesel(sql_type = Text)]
    id: String,
}

/// The claim of the job `j`'s current ready entry, as the `FROM` and `WHERE`
/// of a subquery over `job_claims k`. The statements read it through such
/// subqueries (one probe of the claims' key per job), never through a join: a
/// statement's plan is chosen once per connection, and a join planned while the
/// claims were few hashed the whole table on every call once they were many (a
/// 100,000-job drain at a third of its speed).
pub(crate) const CURRENT_CLAIM_SQL: &str =
    "FROM job_claims k WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id";

/// The job `j`'s current claim is of the attempt `attempt` (an SQL expression):
/// the job is still `created` or `retry` (a claim leaves those unchanged; every
/// end writes another state or a new `ready_seq`) and a claim of its current
/// ready entry has that attempt. No claim: false.
pub(crate) fn claim_fence_sql(attempt_matches: impl FnOnce(&str) -> String) -> String {
    let attempt = format!("(SELECT k.attempt {CURRENT_CLAIM_SQL})");
    format!(
        "j.state IN ('created', 'retry') AND {}",
        attempt_matches(&attempt)
    )
}

/// The fence of the single-job statements: `$1` the id, `$2` the attempt.
pub(crate) static CLAIM_FENCE_BY_TOKEN_SQL: LazyLock<String> =
    LazyLock::new(|| format!("j.id = $1 AND {}", claim_fence_sql(|a| format!("{a} = $2"))));

/// What every end of an attempt writes besides its state: the attempt and the
/// start of the claim it ends (the job's row is not written when it is claimed).
pub(crate) static CLAIM_ENDED_SET_SQL: LazyLock<String> = LazyLock::new(|| {
    format!("(attempt, started_at) = (SELECT k.attempt, k.claimed_at {CURRENT_CLAIM_SQL})")
});

/// The CTE `closed`: the closure of the current ready entry of every job `j`
/// that `fence` selects, appended with `outcome`
/// and `output` (SQL expressions), in id order (two statements closing the same
/// jobs wait for each other in one order). `ON CONFLICT`: an entry already
/// closed, or being closed by a transaction that then commits, is left out; its
/// `ready_seq` is not returned, and the statement's row write (below,
/// [`ROW_ENDS_SQL`]) leaves its job alone.
pub(crate) fn closure_cte(outcome: &str, output: &str, fence: &str) -> String {
    format!(
        "closed AS (
    INSERT INTO job_closures (ready_seq, job_id, attempt, queue, tenant_id, priority,
                              outcome, output)
    SELECT j.ready_seq, j.id, coalesce((SELECT k.attempt {CURRENT_CLAIM_SQL}), j.attempt),
           j.queue, j.tenant_id, j.priority, {outcome}, {output}
      FROM jobs j
     WHERE {fence}
     ORDER BY j.id
    ON CONFLICT (ready_seq) DO NOTHING
    RETURNING ready_seq, job_id, attempt
)"
    )
}

/// The jobs `j` whose row an end writes, besides its fence: those whose
/// closure the statement's [`closure_cte`] inserted.
pub(crate) const ROW_ENDS_SQL: &str = "j.ready_seq IN (SELECT ready_seq FROM closed)";

/// An entry `k` (a claim) without a closure: still open.
pub(crate) const NOT_CLOSED_SQL: &str =
    "(SELECT 1 FROM job_closures z WHERE z.ready_seq = k.ready_seq) IS NULL";

/// `complete`: binds `$1` id (text), `$2` attempt (int4), `$3` output (jsonb, NULL
/// for none). Returns `n`: 1 completed (its closure appended); 0 fenced.
pub(crate) static COMPLETE_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}
SELECT count(*) AS n FROM closed",
        closed = closure_cte("'completed'", "$3", &CLAIM_FENCE_BY_TOKEN_SQL),
    )
});

#[derive(diesel::QueryableByName)]
struct Ended {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    n: i64,
}

/// Marks the job completed (with an optional output). `Fenced`: the lease was
/// taken over, nothing changed.
pub async fn complete(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
    output: Option<&serde_json::Value>,
) -> Result<JobCompleteOutcome, RepoError> {
    completed(
        crate::db::pinned(conn, async move |conn| {
            complete_statement(conn, id, attempt, output).await
        })
        .await,
    )
}

/// [`complete`] inside an open transaction, on a shared reference to its
/// connection, to be sent together with the transaction's other statements.
pub(crate) async fn complete_pipelined(
    conn: &AsyncPgConnection,
    id: JobId,
    attempt: i32,
) -> Result<JobCompleteOutcome, RepoError> {
    completed(complete_statement(conn, id, attempt, None).await)
}

async fn complete_statement(
    mut conn: &AsyncPgConnection,
    id: JobId,
    attempt: i32,
    output: Option<&serde_json::Value>,
) -> Result<i64, diesel::result::Error> {
    let ended: Ended = diesel::sql_query(COMPLETE_SQL.as_str())
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .bind::<Nullable<Jsonb>, _>(output)
        .cached()
        .get_result(&mut conn)
        .await?;
    Ok(ended.n)
}

/// What the completion's count says: nothing ended means fenced.
fn completed(ended: Result<i64, diesel::result::Error>) -> Result<JobCompleteOutcome, RepoError> {
    Ok(match ended.map_err(map_diesel_error)? {
        1 => JobCompleteOutcome::Completed,
        _ => JobCompleteOutcome::Fenced,
    })
}

/// The failure transition shared by `fail` and lease expiry: `{retry}` decides
/// between retry (with the job's delay) and final failure. Uses `j` for the row;
/// the claim it ends is the job's current one.
pub(crate) fn failure_set_sql(retry: &str) -> String {
    let ended = &*CLAIM_ENDED_SET_SQL;
    format!(
        "{ended},
         state = CASE WHEN {retry} THEN 'retry' ELSE 'failed' END,
         retry_count = j.retry_count + CASE WHEN {retry} THEN 1 ELSE 0 END,
         start_after = CASE WHEN {retry}
                            THEN now() + ({RETRY_DELAY_MS_SQL}) * interval '1 millisecond'
                            ELSE j.start_after END,
         completed_at = CASE WHEN {retry} THEN NULL ELSE now() END,
         lease_expires_at = NULL"
    )
}

/// The dead-letter copy of failed rows `src` (a CTE with the columns of `jobs`):
/// payload, priority and tenant (the payload's, which the baseline migration checks),
/// and a last_error naming the original job and its error.
pub(crate) fn dead_letter_insert_sql(new_id: &str, src: &str, extra_where: &str) -> String {
    let valid_queue = VALID_QUEUE_SQL.replace("{col}", &format!("{src}.dead_letter"));
    format!(
        "INSERT INTO jobs (id, queue, priority, payload, tenant_id, last_error)
         SELECT {new_id}, {src}.dead_letter, {src}.priority, {src}.payload, {src}.tenant_id,
                format('dead-lettered from job %s of queue %s: %s',
                       {src}.id, {src}.queue, {src}.last_error)
           FROM {src}
          WHERE {src}.state = 'failed' AND {valid_queue} {extra_where}
         RETURNING id, queue"
    )
}

#[derive(diesel::QueryableByName)]
struct FailRow {
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Timestamptz)]
    start_after: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    dead_letter_id: Option<String>,
}

/// `fail`: binds `$1` id (text), `$2` attempt (int4), `$3` error (text), `$4`
/// retryable (bool), `$5` the id of a dead-letter copy (text). Returns the new state,
/// its `start_after` and the dead-letter copy's id; no row: fenced.
pub(crate) static FAIL_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}, failed AS (
             UPDATE jobs j SET {set}, last_error = $3
              WHERE {fence} AND {ROW_ENDS_SQL}
             RETURNING j.*
         ), dl AS (
             {dl}
         ), notified AS (
             SELECT count(pg_notify('idemstage_jobs', queue)) AS n FROM (
                 SELECT queue FROM dl
                 UNION SELECT queue FROM failed WHERE state = 'retry' AND start_after <= now()
             ) q
         )
         SELECT failed.state, failed.start_after, dl.id AS dead_letter_id
           FROM failed LEFT JOIN dl ON true CROSS JOIN notified",
        closed = closure_cte("'failed'", "NULL", &CLAIM_FENCE_BY_TOKEN_SQL),
        set = failure_set_sql("($4 AND j.retry_count < j.retry_limit)"),
        fence = *CLAIM_FENCE_BY_TOKEN_SQL,
        dl = dead_letter_insert_sql("$5", "failed", ""),
    )
});

/// Records a failure of the job's current attempt. With retries left (and a
/// retryable failure) the job goes to `retry`, fetchable after its retry delay;
/// otherwise it is `failed` and, with a dead-letter queue, a copy is sent there in
/// the same statement. A retry due now wakes the listeners. `Fenced`: the lease was
/// taken over, nothing was recorded.
///
/// `error` is stored as given: pass it through `sanitize_error_text` first (a NUL
/// character makes the statement fail).
pub async fn fail(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
    error: &str,
    kind: FailKind,
) -> Result<JobFailOutcome, RepoError> {
    let query = diesel::sql_query(FAIL_SQL.as_str())
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .bind::<Text, _>(error)
        .bind::<Bool, _>(kind == FailKind::Transient)
        .bind::<Text, _>(JobId::new().to_string())
        .cached();
    let row: Option<FailRow> =
        crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
            .await
            .optional()
            .map_err(map_diesel_error)?;
    let Some(row) = row else {
        return Ok(JobFailOutcome::Fenced);
    };
    Ok(if row.state == "retry" {
        JobFailOutcome::Retrying {
            start_after: row.start_after,
        }
    } else {
        JobFailOutcome::Failed {
            dead_lettered: row
                .dead_letter_id
                .as_deref()
                .map(JobId::parse)
                .transpose()?,
        }
    })
}

/// `cancel`: binds `$1` id (text), `$2` attempt (int4). No row updated: fenced.
pub(crate) static CANCEL_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}
UPDATE jobs j SET state = 'cancelled', completed_at = now(), {set}
 WHERE {fence} AND {ROW_ENDS_SQL}",
        closed = closure_cte("'cancelled'", "NULL", &CLAIM_FENCE_BY_TOKEN_SQL),
        set = *CLAIM_ENDED_SET_SQL,
        fence = *CLAIM_FENCE_BY_TOKEN_SQL,
    )
});

/// Cancels the job's current attempt for good (no retry, no dead letter).
pub async fn cancel(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
) -> Result<JobCancelOutcome, RepoError> {
    let query = diesel::sql_query(CANCEL_SQL.as_str())
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .cached();
    let n = crate::db::pinned(conn, async move |conn| query.execute(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(if n == 1 {
        JobCancelOutcome::Cancelled
    } else {
        JobCancelOutcome::Fenced
    })
}

/// Gives the job back for another worker now, without counting a failure (used by
/// a worker shutting down with the job unfinished). Wakes the listeners.
pub async fn retry_now(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
) -> Result<JobRetryOutcome, RepoError> {
    retry_at(conn, id, attempt, None).await
}

/// `retry_at`: binds `$1` id (text), `$2` attempt (int4), `$3` not before
/// (timestamptz, NULL for now). Returns `(id, notified)`; no row: fenced.
pub(crate) static RETRY_AT_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}, released AS (
    UPDATE jobs j SET state = 'retry', start_after = greatest(now(), $3), {set}
     WHERE {fence} AND {ROW_ENDS_SQL}
    RETURNING j.id, j.queue
)
SELECT id, pg_notify('idemstage_jobs', queue) IS NULL AS notified FROM released",
        closed = closure_cte("'released'", "NULL", &CLAIM_FENCE_BY_TOKEN_SQL),
        set = *CLAIM_ENDED_SET_SQL,
        fence = *CLAIM_FENCE_BY_TOKEN_SQL,
    )
});

/// Gives the job back to be fetched again no earlier than `not_before` (or now),
/// without counting a failure: for a job that must wait for something else, e.g.
/// another worker's live claim on the same stage.
pub async fn retry_at(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
    not_before: Option<DateTime<Utc>>,
) -> Result<JobRetryOutcome, RepoError> {
    let query = diesel::sql_query(RETRY_AT_SQL.as_str())
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .bind::<diesel::sql_types::Nullable<diesel::sql_types::Timestamptz>, _>(not_before)
        .cached();
    let row: Option<IdRow> =
        crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
            .await
            .optional()
            .map_err(map_diesel_error)?;
    Ok(if row.is_some_and(|r| r.id == id.to_string()) {
        JobRetryOutcome::Requeued
    } else {
        JobRetryOutcome::Fenced
    })
}

/// Result of a lease renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewLeaseOutcome {
    /// The job's lease is extended.
    Renewed {
        /// The new end of the lease (database clock).
        lease_expires_at: DateTime<Utc>,
    },
    /// The job is no longer active under this attempt (expired by maintenance,
    /// fetched again, or already ended): nothing changed, and this worker no longer
    /// holds the job.
    Fenced,
}

/// `renew_lease`: binds `$1` id (text), `$2` attempt (int4). Returns the new
/// `lease_expires_at`; no row: fenced.
///
/// The claim's deadline moves (an UPDATE of the claim: long stages only). The
/// job's row is locked FOR SHARE, so that an end of the same attempt, which
/// writes that row, waits for the renewal or the renewal for it; expiry reads
/// the deadlines after it has locked the rows (`maintenance.rs`). A claim with
/// a closure has ended: fenced.
pub(crate) static RENEW_LEASE_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH j AS (
    SELECT id, ready_seq, state, expire_in_ms FROM jobs
     WHERE id = $1 AND state IN ('created', 'retry')
       FOR SHARE
)
UPDATE job_claims k SET lease_expires_at = now() + j.expire_in_ms * interval '1 millisecond'
  FROM j
 WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id AND k.attempt = $2
   AND {NOT_CLOSED_SQL}
RETURNING k.lease_expires_at"
    )
});

/// Extends the lease of a long-running job to `now() + expire_in` (database clock).
pub async fn renew_lease(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
) -> Result<RenewLeaseOutcome, RepoError> {
    #[derive(diesel::QueryableByName)]
    struct Lease {
        #[diesel(sql_type = Timestamptz)]
        lease_expires_at: DateTime<Utc>,
    }
    let query = diesel::sql_query(RENEW_LEASE_SQL.as_str())
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .cached();
    let row: Option<Lease> =
        crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
            .await
            .optional()
            .map_err(map_diesel_error)?;
    Ok(match row {
        Some(l) => RenewLeaseOutcome::Renewed {
            lease_expires_at: l.lease_expires_at,
        },
        None => RenewLeaseOutcome::Fenced,
    })
}
