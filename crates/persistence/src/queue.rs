//! Layer 2: the job queue on `jobs`.

use diesel::sql_types::{BigInt, Bool, Integer, Jsonb, Nullable, Text};
use diesel::OptionalExtension;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{JobId, JobToSend, RepoError, SendResult};

use crate::error::map_diesel_error;

/// The NOTIFY channel a send signals (inside its transaction: it fires on commit).
pub const NOTIFY_CHANNEL: &str = "idemstage_jobs";

fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Insert, then NOTIFY only if a row was inserted: one round trip.
/// `{conflict}` is the ON CONFLICT clause; the live-singleton variant names the partial
/// index `jobs_singleton_live_uq` by its columns and predicate.
const SEND_SQL: &str = "\
WITH inserted AS (
    INSERT INTO jobs (id, queue, priority, payload, singleton_key, singleton_on,
                      retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms,
                      expire_in_ms, dead_letter, start_after)
    VALUES ($1, $2, $3, $4, $5,
            CASE WHEN $6::int IS NULL THEN NULL
                 ELSE to_timestamp(floor(extract(epoch FROM now()) / $6) * $6) END,
            $7, $8, $9, $10, $11, $12, now() + $13 * interval '1 millisecond')
    {conflict}
    RETURNING id, queue
)
SELECT id, pg_notify('idemstage_jobs', queue) IS NULL AS notified FROM inserted";

const LIVE_SINGLETON_CONFLICT: &str = "ON CONFLICT (queue, singleton_key) \
     WHERE singleton_key IS NOT NULL AND state IN ('created', 'retry', 'active') DO NOTHING";
/// With a throttle window both the live index and the window index arbitrate.
const ANY_CONFLICT: &str = "ON CONFLICT DO NOTHING";

#[derive(diesel::QueryableByName)]
struct Inserted {
    #[diesel(sql_type = Text)]
    id: String,
}

/// Sends one job on the caller's connection (and so inside the caller's transaction,
/// if one is open). A second live job with the same `(queue, singleton_key)` is a
/// `Duplicate`, decided by the partial unique index `jobs_singleton_live_uq`.
pub async fn send_in(
    conn: &mut AsyncPgConnection,
    job: &JobToSend,
) -> Result<SendResult, RepoError> {
    validate_queue_name(&job.queue)?;
    job.options.validate()?;
    let o = &job.options;
    let id = JobId::new();
    let sql = SEND_SQL.replace(
        "{conflict}",
        if o.singleton_seconds.is_some() {
            ANY_CONFLICT
        } else {
            LIVE_SINGLETON_CONFLICT
        },
    );
    let inserted: Option<Inserted> = diesel::sql_query(sql)
        .bind::<Text, _>(id.to_string())
        .bind::<Text, _>(&job.queue)
        .bind::<Integer, _>(o.priority)
        .bind::<Jsonb, _>(&job.payload)
        .bind::<Nullable<Text>, _>(o.singleton_key.as_deref())
        .bind::<Nullable<Integer>, _>(o.singleton_seconds.map(|s| s.min(i32::MAX as u32) as i32))
        .bind::<Integer, _>(o.retry_limit)
        .bind::<BigInt, _>(millis(o.retry_delay))
        .bind::<Bool, _>(o.retry_backoff)
        .bind::<Nullable<BigInt>, _>(o.retry_delay_max.map(millis))
        .bind::<BigInt, _>(millis(o.expire_in))
        .bind::<Nullable<Text>, _>(o.dead_letter.as_deref())
        .bind::<BigInt, _>(millis(o.start_after.unwrap_or_default()))
        .get_result(conn)
        .await
        .optional()
        .map_err(map_diesel_error)?;
    Ok(match inserted {
        Some(row) => SendResult::Sent(JobId::parse(&row.id)?),
        None => SendResult::Duplicate,
    })
}
