//! Fetching: lease up to N jobs in one statement.

use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{FailKind, FetchedJob, JobId, RepoError};

use crate::cached::CachedExt;
use crate::error::map_diesel_error;

/// `FOR UPDATE SKIP LOCKED` lets concurrent fetchers pass each other's rows instead
/// of queueing behind them; the outer UPDATE then leases exactly the rows this
/// statement locked, found by their `ctid` (see `LEASE_SQL`). Order: priority DESC,
/// then id (a ULID, so oldest first), which is the order of `jobs_fetch_idx`: an
/// ordered index scan that stops after N rows.
const FETCH_ONE_QUEUE_SQL: &str = "\
WITH next AS (
    SELECT ctid FROM jobs
     WHERE queue = $1
       AND state IN ('created', 'retry')
       AND start_after <= now()
     ORDER BY priority DESC, id
     LIMIT $2
     FOR UPDATE SKIP LOCKED
)
{lease}";

/// With several queues, `queue = ANY($1)` cannot use the index order (the planner
/// sorts the whole backlog), so each queue gets its own ordered index scan of at most
/// N rows and the best N of those are leased. Candidates locked but not chosen stay
/// locked only until this statement's transaction ends.
const FETCH_MANY_QUEUES_SQL: &str = "\
WITH next AS (
    SELECT c.ctid FROM unnest($1::text[]) AS q(name)
    CROSS JOIN LATERAL (
        SELECT ctid, id, priority FROM jobs
         WHERE queue = q.name
           AND state IN ('created', 'retry')
           AND start_after <= now()
         ORDER BY priority DESC, id
         LIMIT $2
         FOR UPDATE SKIP LOCKED
    ) c
    ORDER BY c.priority DESC, c.id
    LIMIT $2
)
{lease}";

/// The locked rows are updated through a TID scan of their `ctid`s: a row locked by
/// this statement cannot move until it ends, so the ctid still names it, and there
/// is no join for the planner to get wrong. (Joined on `id`, the planner costs the
/// CTE at its LIMIT and, on a table of a few thousand rows, hashes a sequential
/// scan of the whole table for every fetch.) `ARRAY(...)` hides the batch size from
/// the planner, which would otherwise cost one random page read per TID. A row that
/// another transaction changed after this statement's snapshot is locked (as its
/// newest version) but not visible to the TID scan: it is left as it was and
/// fetched next time.
const LEASE_SQL: &str = "\
UPDATE jobs j
   SET state = 'active',
       attempt = j.attempt + 1,
       started_at = now(),
       lease_expires_at = now() + j.expire_in_ms * interval '1 millisecond'
WHERE j.ctid = ANY(ARRAY(SELECT ctid FROM next))
RETURNING j.id, j.queue, j.payload::text AS payload, j.priority, j.singleton_key, j.attempt, j.retry_count,
          j.retry_limit, j.expire_in_ms, j.lease_expires_at, j.created_at, j.last_error";

/// `fetch` of one queue: binds `$1` queue (text), `$2` limit (int8). Returns the
/// leased rows (the columns of `FetchedRow`).
pub(crate) static FETCH_ONE_QUEUE: LazyLock<String> =
    LazyLock::new(|| FETCH_ONE_QUEUE_SQL.replace("{lease}", LEASE_SQL));
/// `fetch` of several queues: binds `$1` queues (text[]), `$2` limit (int8).
pub(crate) static FETCH_MANY_QUEUES: LazyLock<String> =
    LazyLock::new(|| FETCH_MANY_QUEUES_SQL.replace("{lease}", LEASE_SQL));

#[derive(diesel::QueryableByName)]
pub(crate) struct FetchedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    queue: String,
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
/// `start_after <= now()`), highest priority first, then oldest. Each is marked
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
    if queues.is_empty() || limit == 0 {
        return Ok(Vec::new());
    }
    let limit = i64::from(limit);
    let rows: Vec<FetchedRow> = if let [queue] = queues {
        diesel::sql_query(FETCH_ONE_QUEUE.as_str())
            .bind::<Text, _>(queue)
            .bind::<BigInt, _>(limit)
            .cached()
            .load(conn)
            .await
    } else {
        diesel::sql_query(FETCH_MANY_QUEUES.as_str())
            .bind::<Array<Text>, _>(queues)
            .bind::<BigInt, _>(limit)
            .cached()
            .load(conn)
            .await
    }
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
    // RETURNING does not keep the order of the CTE.
    jobs.sort_by(|a, b| b.priority.cmp(&a.priority).then(a.id.cmp(&b.id)));
    Ok(jobs)
}
