//! Giving a fetched job back to wait, without counting a failure.

use std::sync::LazyLock;
use std::time::Duration;

use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{JobId, JobRetryOutcome, RepoError};

use super::finish::{closure_cte, CLAIM_ENDED_SET_SQL, CLAIM_FENCE_BY_TOKEN_SQL, ROW_ENDS_SQL};
use crate::cached::CachedExt;
use crate::error::map_diesel_error;

/// `retry_after`: binds `$1` id (text), `$2` attempt (int4), `$3` delay in ms
/// (int8). No row updated: fenced.
pub(crate) static RETRY_AFTER_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}
UPDATE jobs j SET state = 'retry', start_after = now() + $3 * interval '1 millisecond',
                  {ended}
 WHERE {fence} AND {ROW_ENDS_SQL}",
        closed = closure_cte("'released'", "NULL", &CLAIM_FENCE_BY_TOKEN_SQL),
        ended = *CLAIM_ENDED_SET_SQL,
        fence = *CLAIM_FENCE_BY_TOKEN_SQL,
    )
});

/// Gives the job back to be fetched again `delay` from now (database clock),
/// without counting a failure: for a job that must wait for the database to
/// recover, or for its upstream stage. Fenced on the job's token: `Fenced` means
/// the lease was taken over and nothing changed. Sends no notification: the job is
/// found by a fetch after the delay.
pub async fn retry_after(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
    delay: Duration,
) -> Result<JobRetryOutcome, RepoError> {
    let query = diesel::sql_query(RETRY_AFTER_SQL.as_str())
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .bind::<BigInt, _>(super::millis(delay))
        .cached();
    let n = crate::db::pinned(conn, async move |conn| query.execute(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(if n == 1 {
        JobRetryOutcome::Requeued
    } else {
        JobRetryOutcome::Fenced
    })
}
