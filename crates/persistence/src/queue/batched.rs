//! The batched forms of the fenced statements: complete, renew or give back many
//! jobs in one statement. Each entry is fenced on its own claim `(id, attempt)`
//! being the job's current one, exactly as the single-job statement would be
//! (`finish.rs`), and gets its own outcome, in input order.
//!
//! The tokens travel as one JSON object `{id: [attempt, ...]}`, so no statement has
//! a join for the planner to choose: the jobs are probed by primary key (the key
//! array behind `ARRAY(...)` is costed at a few elements, so even a small table is
//! not scanned whole) and each row's fence is a key lookup in the object. Joined
//! with `unnest` of the tokens instead, the planner hashed a scan of the whole table
//! on small tables, and, when statistics said no job was active, looped over every
//! active job once per token. A job's claim is read the same way, by a subquery
//! on its key ([`CURRENT_CLAIM_SQL`](super::finish::CURRENT_CLAIM_SQL)).

use std::collections::HashMap;
use std::io::Write;
use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use diesel::pg::Pg;
use diesel::serialize::{IsNull, Output, ToSql};
use diesel::sql_types::{Integer, Jsonb, Text, Timestamptz};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{JobCompleteOutcome, JobId, JobRetryOutcome, RepoError};

use super::finish::{
    claim_fence_sql, closure_cte, CLAIM_ENDED_SET_SQL, NOT_CLOSED_SQL, ROW_ENDS_SQL,
};
use super::RenewLeaseOutcome;
use crate::cached::CachedExt;
use crate::error::map_diesel_error;

/// The fence every batched statement shares, over `jobs j`: `$1` is the token
/// object `{id: [attempt, ...]}`; the job's current claim is of one of its
/// attempts.
static FENCED_BY_TOKENS_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "j.id = ANY(ARRAY(SELECT jsonb_object_keys($1))) AND {}",
        claim_fence_sql(|attempt| format!("($1 -> j.id::text) @> to_jsonb({attempt})"))
    )
});

/// `complete_many`: binds `$1`, the tokens as a jsonb object `{id: [attempt, ...]}`.
/// Returns the `(id, attempt)` of every job it completed (its closure appended).
pub(crate) static COMPLETE_MANY_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}
SELECT job_id AS id, attempt FROM closed",
        closed = closure_cte("'completed'", "NULL", &FENCED_BY_TOKENS_SQL),
    )
});

/// `renew_leases`: binds `$1`, the tokens as a jsonb object. Returns the `(id,
/// attempt, lease_expires_at)` of every job whose lease it extended to `now() +
/// expire_in`. The jobs' rows are locked FOR SHARE, as in `renew_lease`; a
/// claim with a closure has ended.
pub(crate) static RENEW_LEASES_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH j AS (
    SELECT id, ready_seq, state, expire_in_ms FROM jobs
     WHERE id = ANY(ARRAY(SELECT jsonb_object_keys($1))) AND state IN ('created', 'retry')
     ORDER BY id
       FOR SHARE
)
UPDATE job_claims k SET lease_expires_at = now() + j.expire_in_ms * interval '1 millisecond'
  FROM j
 WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id
   AND ($1 -> j.id::text) @> to_jsonb(k.attempt)
   AND {NOT_CLOSED_SQL}
RETURNING k.job_id AS id, k.attempt, k.lease_expires_at"
    )
});

/// `retry_now_many`: binds `$1`, the tokens as a jsonb object. Returns the `(id,
/// attempt)` of every job it gave back; wakes the listeners of their queues
/// (PostgreSQL delivers one notification per distinct queue of the transaction).
pub(crate) static RETRY_NOW_MANY_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {closed}, released AS (
UPDATE jobs j SET state = 'retry', start_after = now(), {ended}
 WHERE {fence} AND {ROW_ENDS_SQL}
RETURNING j.id, j.attempt, j.queue
)
SELECT id, attempt, pg_notify('idemstage_jobs', queue) IS NULL AS notified FROM released",
        closed = closure_cte("'released'", "NULL", &FENCED_BY_TOKENS_SQL),
        ended = *CLAIM_ENDED_SET_SQL,
        fence = *FENCED_BY_TOKENS_SQL,
    )
});

#[derive(diesel::QueryableByName)]
struct Token {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
}

#[derive(diesel::QueryableByName)]
struct Lease {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Timestamptz)]
    lease_expires_at: DateTime<Utc>,
}

/// The token object `$1`, `{id: [attempt, ...]}`. Every token of a job goes
/// along: the same job listed twice with different attempts is changed if either
/// is its current token.
///
/// Written straight into the bind parameter (jsonb's wire form: a version byte,
/// then the text) instead of through a `serde_json::Value`: a worker builds one
/// per batch of completions, and the map of strings it took cost as much of the
/// worker's CPU as the statement's own round trip.
#[derive(Debug)]
struct TokenObject(Vec<(JobId, i32)>);

impl TokenObject {
    fn new(jobs: &[(JobId, i32)]) -> Self {
        let mut tokens = jobs.to_vec();
        // A job's tokens next to each other, to share its key.
        tokens.sort_unstable();
        Self(tokens)
    }
}

impl ToSql<Jsonb, Pg> for TokenObject {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> diesel::serialize::Result {
        // jsonb's binary format version, as diesel's own `serde_json::Value` writes.
        out.write_all(&[1])?;
        out.write_all(b"{")?;
        let mut previous: Option<JobId> = None;
        for (id, attempt) in &self.0 {
            if previous == Some(*id) {
                write!(out, ",{attempt}")?;
                continue;
            }
            let separator = if previous.is_some() { "]," } else { "" };
            // A ULID is Crockford base32: nothing in it needs escaping.
            write!(out, "{separator}\"{id}\":[{attempt}")?;
            previous = Some(*id);
        }
        out.write_all(if previous.is_some() { b"]}" } else { b"}" })?;
        Ok(IsNull::No)
    }
}

/// Runs `sql` for `jobs`; the rows it changed.
async fn run<R>(
    conn: &mut AsyncPgConnection,
    sql: &'static str,
    jobs: &[(JobId, i32)],
) -> Result<Vec<R>, RepoError>
where
    R: diesel::QueryableByName<diesel::pg::Pg> + Send + 'static,
{
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    let query = diesel::sql_query(sql)
        .bind::<Jsonb, _>(TokenObject::new(jobs))
        .cached();
    crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)
}

/// Per entry of `jobs`, in input order, whether its token is among `changed`.
/// Keyed by (id, attempt): an entry with a stale token is fenced even when another
/// entry of the same job changed it.
fn changed_in_order(jobs: &[(JobId, i32)], changed: Vec<Token>) -> Result<Vec<bool>, RepoError> {
    // Parsed once and searched sorted: no id is formatted per token.
    let mut done = changed
        .into_iter()
        .map(|r| Ok((JobId::parse(&r.id)?, r.attempt)))
        .collect::<Result<Vec<(JobId, i32)>, RepoError>>()?;
    done.sort_unstable();
    Ok(jobs
        .iter()
        .map(|token| done.binary_search(token).is_ok())
        .collect())
}

/// Completes many jobs in one statement; outcomes are in input order, `Fenced` for
/// every entry whose token is not the job's current one (or the job not active).
pub async fn complete_many(
    conn: &mut AsyncPgConnection,
    jobs: &[(JobId, i32)],
) -> Result<Vec<JobCompleteOutcome>, RepoError> {
    let changed = run(conn, COMPLETE_MANY_SQL.as_str(), jobs).await?;
    Ok(changed_in_order(jobs, changed)?
        .into_iter()
        .map(|done| {
            if done {
                JobCompleteOutcome::Completed
            } else {
                JobCompleteOutcome::Fenced
            }
        })
        .collect())
}

/// Extends the leases of many jobs to `now() + expire_in` each (database clock) in
/// one statement: what a worker sends for all the jobs it holds. Outcomes are in
/// input order; `Fenced` means that job's lease was taken over, and its holder must
/// stop.
pub async fn renew_leases(
    conn: &mut AsyncPgConnection,
    jobs: &[(JobId, i32)],
) -> Result<Vec<RenewLeaseOutcome>, RepoError> {
    let rows: Vec<Lease> = run(conn, RENEW_LEASES_SQL.as_str(), jobs).await?;
    let renewed = rows
        .into_iter()
        .map(|r| Ok(((JobId::parse(&r.id)?, r.attempt), r.lease_expires_at)))
        .collect::<Result<HashMap<(JobId, i32), DateTime<Utc>>, RepoError>>()?;
    Ok(jobs
        .iter()
        .map(|token| match renewed.get(token) {
            Some(&lease_expires_at) => RenewLeaseOutcome::Renewed { lease_expires_at },
            None => RenewLeaseOutcome::Fenced,
        })
        .collect())
}

/// Gives many jobs back for another worker now, without counting a failure (what a
/// worker shutting down does with the jobs it fetched but never started), in one
/// statement; wakes the listeners. Outcomes are in input order.
pub async fn retry_now_many(
    conn: &mut AsyncPgConnection,
    jobs: &[(JobId, i32)],
) -> Result<Vec<JobRetryOutcome>, RepoError> {
    let changed = run(conn, RETRY_NOW_MANY_SQL.as_str(), jobs).await?;
    Ok(changed_in_order(jobs, changed)?
        .into_iter()
        .map(|done| {
            if done {
                JobRetryOutcome::Requeued
            } else {
                JobRetryOutcome::Fenced
            }
        })
        .collect())
}
