//! Fetching: lease up to N jobs in one statement.

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{FailKind, FetchedJob, JobId, RepoError, TenantId};

use crate::cached::CachedExt;
use crate::error::map_diesel_error;

/// The fair fetch of migration `2026-11-30-000000_baseline` (its comment says
/// how shares are given): binds `$1` queues (text[]), `$2` limit (int4). One
/// round trip; PL/pgSQL keeps the plan of its statement between calls.
pub(crate) const FETCH_SQL: &str = "SELECT * FROM idemstage_fetch($1, $2)";

/// [`FETCH_SQL`] with the fetch's own transaction committed asynchronously:
/// `set_config` with `is_local` lasts until that commit, which is the one that
/// reads it. A one-row function scan, so the planner runs it first; run after the
/// fetch, it would still come before the commit.
pub(crate) const FETCH_ASYNC_COMMIT_SQL: &str = "SELECT f.* FROM set_config('synchronous_commit', 'off', true) AS s, idemstage_fetch($1, $2) AS f";

/// How the commit of a fetch, the one that takes the jobs' leases, waits for the
/// write-ahead log.
///
/// A lease is the one write the queue can afford to lose: if the server crashes
/// before an asynchronous commit reached the disk, the jobs come back as they
/// were before the fetch, fetchable at once, as after any crash of a worker. Any
/// later durable commit on the server (the stage's claim, a completion, a
/// lease renewal) flushes the log up to it, so the window is short. What the
/// loss costs: a job whose lease was lost may run once more, and since the
/// attempt counter was lost with it, the new delivery gets the same fencing token
/// as the one lost, so the first holder's completion is accepted too. A stage's
/// body is not affected: it starts only after its claim, a durable commit, which
/// flushes the fetch with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LeaseCommit {
    /// `synchronous_commit = off` for the fetch's transaction: the fetch returns
    /// without waiting for the log flush (a fsync with a durable server). Inside a
    /// caller's transaction nothing changes: its own commit decides.
    #[default]
    Asynchronous,
    /// The session's `synchronous_commit`: leases survive a crash of the server
    /// like every other commit.
    Durable,
}

#[derive(diesel::QueryableByName)]
pub(crate) struct FetchedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    tenant_id: String,
    /// As text, decoded per row: a payload the JSON decoder refuses (e.g. nested
    /// deeper than its recursion limit) must fail its own job, not the whole batch
    /// (whose rows this statement has already leased).
    #[diesel(sql_type = Text)]
    payload: String,
    #[diesel(sql_type = Integer)]
    priority: i32,
    #[diesel(sql_type = Nullable<Text>)]
    singleton_key: Option<String>,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Integer)]
    retry_count: i32,
    #[diesel(sql_type = Integer)]
    retry_limit: i32,
    #[diesel(sql_type = BigInt)]
    expire_in_ms: i64,
    #[diesel(sql_type = Timestamptz)]
    lease_expires_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

impl FetchedRow {
    fn into_job(self, payload: serde_json::Value) -> Result<FetchedJob, RepoError> {
        Ok(FetchedJob {
            id: JobId::parse(&self.id)?,
            queue: self.queue,
            tenant: match self.tenant_id.as_str() {
                "" => None,
                slug => Some(TenantId::parse(slug)?),
            },
            payload,
            priority: self.priority,
            singleton_key: self.singleton_key,
            attempt: self.attempt,
            retry_count: self.retry_count,
            retry_limit: self.retry_limit,
            expire_in: Duration::from_millis(u64::try_from(self.expire_in_ms).unwrap_or(0)),
            lease_expires_at: self.lease_expires_at,
            created_at: self.created_at,
            last_error: self.last_error,
        })
    }
}

/// Leases up to `limit` fetchable jobs of `queues` (state created/retry,
/// `start_after <= now()`), shared fairly between the tenants with ready jobs
/// (and between the queues): within a tenant highest priority first, then
/// oldest; across tenants round-robin, the tenant whose first job waited longest
/// first. Each is marked
/// active with `attempt + 1` (its fencing token) and `lease_expires_at = now() +
/// expire_in`. Returned in fetch order.
///
/// A job whose payload does not decode as JSON is failed for good at once
/// (`Permanent`, dead-lettered if it has a queue for that) and left out, so fewer
/// than `limit` jobs can come back while more are fetchable. Inside a transaction
/// the leased rows stay locked until it ends.
pub async fn fetch(
    conn: &mut AsyncPgConnection,
    queues: &[String],
    limit: u32,
) -> Result<Vec<FetchedJob>, RepoError> {
    fetch_with_commit(conn, queues, limit, LeaseCommit::Durable).await
}

/// [`fetch`], its commit as `commit` says when the fetch is a transaction of its
/// own (no transaction open on `conn`); inside the caller's transaction the same
/// as [`fetch`], whatever `commit` says, so that a caller's writes never lose
/// their durability to it.
pub async fn fetch_with_commit(
    conn: &mut AsyncPgConnection,
    queues: &[String],
    limit: u32,
    commit: LeaseCommit,
) -> Result<Vec<FetchedJob>, RepoError> {
    if queues.is_empty() || limit == 0 {
        return Ok(Vec::new());
    }
    let limit = i32::try_from(limit).unwrap_or(i32::MAX);
    let sql = match commit {
        LeaseCommit::Asynchronous if crate::db::outside_transaction(conn) => FETCH_ASYNC_COMMIT_SQL,
        _ => FETCH_SQL,
    };
    let query = diesel::sql_query(sql)
        .bind::<Array<Text>, _>(queues)
        .bind::<Integer, _>(limit)
        .cached();
    let rows: Vec<FetchedRow> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    let mut jobs = Vec::with_capacity(rows.len());
    for row in rows {
        match serde_json::from_str(&row.payload) {
            Ok(payload) => jobs.push(row.into_job(payload)?),
            Err(e) => {
                // Leased by this fetch, so its token is ours: fail it for good.
                let id = JobId::parse(&row.id)?;
                let error = format!("job payload cannot be decoded: {e}");
                tracing::warn!(job = %id, %error, "poison job failed at fetch");
                super::fail(conn, id, row.attempt, &error, FailKind::Permanent).await?;
            }
        }
    }
    Ok(jobs)
}

/// `fetch_wait`: binds `$1` the queues (text[]); milliseconds or NULL.
pub(crate) const FETCH_WAIT_SQL: &str = "SELECT idemstage_fetch_wait($1) AS ms";

#[derive(diesel::QueryableByName)]
struct WaitRow {
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::BigInt>)]
    ms: Option<i64>,
}

/// After a [`fetch`] that came back short: how long until a control of `queues`
/// may let more of their ready jobs through (a rate-limited or held bucket
/// refills, or, for a capped queue, a short re-check, since a slot frees whenever
/// a job ends in any worker). `None`: no ready job waits for a control; wait for
/// a notification or the poll interval. At least 10 ms.
pub async fn fetch_wait(
    conn: &mut AsyncPgConnection,
    queues: &[String],
) -> Result<Option<Duration>, RepoError> {
    if queues.is_empty() {
        return Ok(None);
    }
    let query = diesel::sql_query(FETCH_WAIT_SQL)
        .bind::<Array<Text>, _>(queues)
        .cached();
    let row: WaitRow = crate::db::pinned(conn, async move |conn| query.get_result(conn).await)
        .await
        .map_err(map_diesel_error)?;
    Ok(row
        .ms
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
}
