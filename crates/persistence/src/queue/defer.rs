//! Giving a fetched job back to wait, without counting a failure.

use std::time::Duration;

use diesel::sql_types::{BigInt, Integer, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{JobId, JobRetryOutcome, RepoError};

use crate::cached::CachedExt;
use crate::error::map_diesel_error;

/// Gives the job back to be fetched again `delay` from now (database clock),
/// without counting a failure: for a job that must wait for the database to
/// recover, or for its upstream stage. Fenced on the job's token.
pub(crate) const RETRY_AFTER_SQL: &str = "\
UPDATE jobs SET state = 'retry', start_after = now() + $3 * interval '1 millisecond',
                lease_expires_at = NULL
 WHERE id = $1 AND attempt = $2 AND state = 'active'";

pub async fn retry_after(
    conn: &mut AsyncPgConnection,
    id: JobId,
    attempt: i32,
    delay: Duration,
) -> Result<JobRetryOutcome, RepoError> {
    let n = diesel::sql_query(RETRY_AFTER_SQL)
        .bind::<Text, _>(id.to_string())
        .bind::<Integer, _>(attempt)
        .bind::<BigInt, _>(super::millis(delay))
        .cached()
        .execute(conn)
        .await
        .map_err(map_diesel_error)?;
    Ok(if n == 1 {
        JobRetryOutcome::Requeued
    } else {
        JobRetryOutcome::Fenced
    })
}
