//! A rate limit's bucket held after a provider said "too many requests" (an HTTP
//! 429's Retry-After, [`StageError::RateLimited`](idemstage_domain::StageError)):
//! no job of it is fetched until the hold ends. The buckets themselves are
//! `queue_buckets`, refilled and spent by the fetch (`idemstage_fetch`).

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Nullable, Text, Timestamptz};
use diesel::{OptionalExtension, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{RepoError, TenantId};

use super::millis;
use crate::error::map_diesel_error;

/// Holds a bucket: no job of it is fetched for `after` (an HTTP 429's
/// Retry-After). The bucket is the tenant's when a per-tenant rate applies to it
/// (its own, or the queue's every-tenant rate), else the queue's, so a provider
/// limit that is not per tenant stops the whole queue. A hold never shortens one
/// already in place.
pub async fn hold(
    conn: &mut AsyncPgConnection,
    queue: &str,
    tenant: Option<&TenantId>,
    after: Duration,
) -> Result<(), RepoError> {
    validate_queue_name(queue)?;
    let query = diesel::sql_query(HOLD_SQL)
        .bind::<Text, _>(queue)
        .bind::<Text, _>(tenant.map_or("", |t| t.as_str()))
        .bind::<BigInt, _>(millis(after));
    crate::db::pinned(conn, async move |conn| query.execute(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(())
}

/// `$1` queue, `$2` tenant ('' none), `$3` hold in ms. The held bucket starts
/// empty when the hold ends.
pub(crate) const HOLD_SQL: &str = "\
INSERT INTO queue_buckets AS b (queue, tenant_id, tokens, refilled_at, held_until)
SELECT $1,
       CASE WHEN $2 <> '' AND EXISTS (
                SELECT 1 FROM queue_controls c
                 WHERE c.queue = $1 AND c.scope IN ('*', $2) AND c.rate_count IS NOT NULL)
            THEN $2 ELSE '' END,
       0,
       clock_timestamp() + $3 * interval '1 millisecond',
       clock_timestamp() + $3 * interval '1 millisecond'
ON CONFLICT (queue, tenant_id) DO UPDATE
   SET tokens = 0,
       refilled_at = greatest(b.refilled_at, excluded.refilled_at),
       held_until = greatest(b.held_until, excluded.held_until)";

/// When the bucket of (`queue`, `tenant`) is held until, if it is (`tenant`
/// `None`: the queue's bucket). For tests and operators.
pub async fn held_until(
    conn: &mut AsyncPgConnection,
    queue: &str,
    tenant: Option<&TenantId>,
) -> Result<Option<DateTime<Utc>>, RepoError> {
    #[derive(QueryableByName)]
    struct Held {
        #[diesel(sql_type = Nullable<Timestamptz>)]
        held_until: Option<DateTime<Utc>>,
    }
    let query = diesel::sql_query(
        "SELECT held_until FROM queue_buckets \
          WHERE queue = $1 AND tenant_id = $2 AND held_until > clock_timestamp()",
    )
    .bind::<Text, _>(queue)
    .bind::<Text, _>(tenant.map_or("", |t| t.as_str()));
    let row: Option<Held> = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .optional()
        .map_err(map_diesel_error)?;
    Ok(row.and_then(|r| r.held_until))
}
