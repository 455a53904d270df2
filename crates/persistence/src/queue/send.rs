//! Sending jobs: one, or many in one round trip.

use std::collections::HashSet;
use std::sync::LazyLock;

use diesel::sql_types::{Array, BigInt, Bool, Integer, Jsonb, Nullable, Text};
use diesel::OptionalExtension;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{JobId, JobToSend, RepoError, SendResult};

use super::{millis, Wake};
use crate::cached::CachedExt;
use crate::error::map_diesel_error;
use crate::PgPool;

/// The NOTIFY channel a send signals (inside its transaction: it fires on commit).
/// The payload is the queue name.
pub const NOTIFY_CHANNEL: &str = "idemstage_jobs";

/// Insert, then NOTIFY only if a row was inserted: one round trip. A job with a
/// singleton key takes its key's row in `job_keys` (`jobs`' insert
/// trigger, for every writer); when a rule refuses it (a live job of the key,
/// including one whose end is not yet committed, or one sent in its window, or
/// a wait for a sender of the same key that then commits) the job is not
/// inserted: no row back, `Duplicate`. `{notify}` is
/// the NOTIFY, or `false` for a send whose wake-up comes after the commit
/// ([`Wake::AfterCommit`]).
const SEND_SQL: &str = "\
WITH inserted AS (
    INSERT INTO jobs (id, queue, priority, payload, singleton_key, singleton_on,
                      retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms,
                      expire_in_ms, dead_letter, start_after, tenant_id)
    VALUES ($1, $2, $3, $4, $5,
            CASE WHEN $6::int IS NULL THEN NULL
                 ELSE to_timestamp(floor(extract(epoch FROM now()) / $6) * $6) END,
            $7, $8, $9, $10, $11, $12, now() + $13 * interval '1 millisecond', $14)
    RETURNING id, queue
)
SELECT id, {notify} AS notified FROM inserted";

const NOTIFY_IN_COMMIT: &str = "pg_notify('idemstage_jobs', queue) IS NULL";

/// Built once: the statement cache is keyed by the SQL text, so a text rebuilt per
/// call costs an allocation and a hash of the whole statement every time.
pub(crate) static SEND_SQL_NOTIFYING: LazyLock<String> =
    LazyLock::new(|| SEND_SQL.replace("{notify}", NOTIFY_IN_COMMIT));
pub(crate) static SEND_SQL_QUIET: LazyLock<String> =
    LazyLock::new(|| SEND_SQL.replace("{notify}", "false"));

#[derive(diesel::QueryableByName)]
struct Inserted {
    #[diesel(sql_type = Text)]
    id: String,
}

/// Sends one job on the caller's connection (and so inside the caller's transaction,
/// if one is open). A second live job with the same `(queue, singleton_key)` is a
/// `Duplicate`, decided by the key's row in `job_keys`. The
/// send NOTIFYs its queue's listeners when the transaction commits
/// ([`Wake::InCommit`]).
pub async fn send_in(
    conn: &mut AsyncPgConnection,
    job: &JobToSend,
) -> Result<SendResult, RepoError> {
    send_in_waking(conn, job, Wake::InCommit).await
}

/// [`send_in`], waking the listeners as `wake` says. With [`Wake::AfterCommit`] the
/// transaction sends no NOTIFY (and so takes no database-wide notify lock at
/// commit): the caller passes the queue to its [`Notifier`](super::Notifier) once
/// the transaction committed, or lets the workers' poll find the job.
pub async fn send_in_waking(
    conn: &mut AsyncPgConnection,
    job: &JobToSend,
    wake: Wake,
) -> Result<SendResult, RepoError> {
    let sql = statement_for(job, wake)?;
    sent(crate::db::pinned(conn, async move |conn| send_statement(conn, sql, job).await).await)
}

/// [`send_in_waking`] inside an open transaction, on a shared reference to its
/// connection, so that it can be sent together with the transaction's other
/// statements (diesel-async pipelines futures polled at once).
pub(crate) async fn send_pipelined(
    conn: &AsyncPgConnection,
    job: &JobToSend,
    wake: Wake,
) -> Result<SendResult, RepoError> {
    let sql = statement_for(job, wake)?;
    sent(send_statement(conn, sql, job).await)
}

/// The job's options checked, and the send statement for them and `wake`.
fn statement_for(job: &JobToSend, wake: Wake) -> Result<&'static str, RepoError> {
    validate_queue_name(&job.queue)?;
    job.options.validate()?;
    job.validate_labels()?;
    Ok(match wake {
        Wake::InCommit => &SEND_SQL_NOTIFYING,
        Wake::AfterCommit => &SEND_SQL_QUIET,
    })
}

async fn send_statement(
    mut conn: &AsyncPgConnection,
    sql: &str,
    job: &JobToSend,
) -> Result<Inserted, diesel::result::Error> {
    let o = &job.options;
    diesel::sql_query(sql)
        .bind::<Text, _>(JobId::new().to_string())
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
        .bind::<Text, _>(job.tenant.as_ref().map_or("", |t| t.as_str()))
        .cached()
        .get_result(&mut conn)
        .await
}

/// What the send statement's result says: no row back is a live duplicate.
fn sent(result: Result<Inserted, diesel::result::Error>) -> Result<SendResult, RepoError> {
    Ok(match result.optional().map_err(map_diesel_error)? {
        Some(row) => SendResult::Sent(JobId::parse(&row.id)?),
        None => SendResult::Duplicate,
    })
}

/// Sends one job on a pooled connection, in a transaction of its own.
pub async fn send(pool: &PgPool, job: &JobToSend) -> Result<SendResult, RepoError> {
    let mut conn = crate::db::get(pool).await?;
    send_in(&mut conn, job).await
}

/// Many sends in one statement. Rows are inserted in input order (`ORDER BY ord`),
/// so of two jobs with the same live key in one batch the first is `Sent` and the
/// second `Duplicate` (its key refused by `jobs`' insert trigger), exactly as two
/// `send_in` calls in a row.
pub(crate) const SEND_BATCH_SQL: &str = "\
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int[], $4::jsonb[], $5::text[],
                         $6::int[], $7::int[], $8::bigint[], $9::bool[], $10::bigint[],
                         $11::bigint[], $12::text[], $13::bigint[], $14::text[])
           WITH ORDINALITY
           AS t(id, queue, priority, payload, singleton_key, singleton_seconds, retry_limit,
                retry_delay_ms, retry_backoff, retry_delay_max_ms, expire_in_ms,
                dead_letter, start_after_ms, tenant_id, ord)
), inserted AS (
    INSERT INTO jobs (id, queue, priority, payload, singleton_key, singleton_on,
                      retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms,
                      expire_in_ms, dead_letter, start_after, tenant_id)
    SELECT id, queue, priority, payload, singleton_key,
           CASE WHEN singleton_seconds IS NULL THEN NULL
                ELSE to_timestamp(floor(extract(epoch FROM now()) / singleton_seconds)
                                  * singleton_seconds) END,
           retry_limit, retry_delay_ms, retry_backoff, retry_delay_max_ms, expire_in_ms,
           dead_letter, now() + start_after_ms * interval '1 millisecond', tenant_id
      FROM input
     ORDER BY ord
    RETURNING id, queue
), notified AS (
    -- One NOTIFY per queue, not per job.
    SELECT count(pg_notify('idemstage_jobs', queue)) AS n
      FROM (SELECT DISTINCT queue FROM inserted) q
)
SELECT inserted.id FROM inserted CROSS JOIN notified";

/// Sends many jobs in one round trip on the caller's connection (and transaction),
/// with the semantics of `send_in` for each; results are in input order. Any invalid
/// job refuses the whole batch before anything is written.
pub async fn send_batch(
    conn: &mut AsyncPgConnection,
    jobs: &[JobToSend],
) -> Result<Vec<SendResult>, RepoError> {
    for job in jobs {
        validate_queue_name(&job.queue)?;
        job.options.validate()?;
        job.validate_labels()?;
    }
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    // A monotonic generator: distinct ids even within one millisecond, in input order.
    let mut generator = ulid::Generator::new();
    let ids: Vec<JobId> = jobs
        .iter()
        .map(|_| {
            generator
                .generate()
                .map(|u| JobId::parse(&u.to_string()))
                .unwrap_or_else(|_| Ok(JobId::new()))
        })
        .collect::<Result<_, _>>()?;
    let opts = jobs.iter().map(|j| &j.options);
    let query = diesel::sql_query(SEND_BATCH_SQL)
        .bind::<Array<Text>, _>(ids.iter().map(|id| id.to_string()).collect::<Vec<_>>())
        .bind::<Array<Text>, _>(jobs.iter().map(|j| j.queue.as_str()).collect::<Vec<_>>())
        .bind::<Array<Integer>, _>(opts.clone().map(|o| o.priority).collect::<Vec<_>>())
        .bind::<Array<Jsonb>, _>(jobs.iter().map(|j| &j.payload).collect::<Vec<_>>())
        .bind::<Array<Nullable<Text>>, _>(
            opts.clone()
                .map(|o| o.singleton_key.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind::<Array<Nullable<Integer>>, _>(
            opts.clone()
                .map(|o| o.singleton_seconds.map(|s| s.min(i32::MAX as u32) as i32))
                .collect::<Vec<_>>(),
        )
        .bind::<Array<Integer>, _>(opts.clone().map(|o| o.retry_limit).collect::<Vec<_>>())
        .bind::<Array<BigInt>, _>(
            opts.clone()
                .map(|o| millis(o.retry_delay))
                .collect::<Vec<_>>(),
        )
        .bind::<Array<Bool>, _>(opts.clone().map(|o| o.retry_backoff).collect::<Vec<_>>())
        .bind::<Array<Nullable<BigInt>>, _>(
            opts.clone()
                .map(|o| o.retry_delay_max.map(millis))
                .collect::<Vec<_>>(),
        )
        .bind::<Array<BigInt>, _>(
            opts.clone()
                .map(|o| millis(o.expire_in))
                .collect::<Vec<_>>(),
        )
        .bind::<Array<Nullable<Text>>, _>(
            opts.clone()
                .map(|o| o.dead_letter.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind::<Array<BigInt>, _>(
            opts.map(|o| millis(o.start_after.unwrap_or_default()))
                .collect::<Vec<_>>(),
        )
        .bind::<Array<Text>, _>(
            jobs.iter()
                .map(|j| j.tenant.as_ref().map_or("", |t| t.as_str()))
                .collect::<Vec<_>>(),
        )
        .cached();
    let inserted: Vec<Inserted> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    let sent: HashSet<String> = inserted.into_iter().map(|r| r.id).collect();
    Ok(ids
        .into_iter()
        .map(|id| {
            if sent.contains(&id.to_string()) {
                SendResult::Sent(id)
            } else {
                SendResult::Duplicate
            }
        })
        .collect())
}
