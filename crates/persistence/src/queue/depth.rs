//! The depth of queues, for gauges: one statement for every queue a worker works.

use diesel::sql_types::{Array, BigInt, Double, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::RepoError;

use crate::cached::CachedExt;
use crate::error::map_diesel_error;

/// Per queue of `$1` (text[]): its ready jobs (`created`/`retry`, due and not
/// claimed), its delayed ones (due later), its active ones (an open claim), and
/// how long the oldest ready job has been due, in seconds (0 without one).
///
/// A job completed by its closure keeps its entry in the ready index until the
/// retention, so the read is bounded as the fetch's is: each lane's entries from
/// its floor (a probe of `job_claims` and `job_closures` each: scalar subqueries,
/// as a join a generic plan may merge all claims); below the floor, the jobs
/// that were not due when they became ready (`jobs_deferred_idx`, where a
/// deferred job waits) and the open claims, from the claims whose lease has not
/// run out (`job_claims_lease_idx`), as a cap counts them.
pub(crate) const QUEUE_DEPTHS_SQL: &str = "\
SELECT q.queue,
       coalesce(r.ready, 0) AS ready, coalesce(r.delayed, 0) AS delayed,
       coalesce(r.active, 0) + coalesce(b.active, 0) AS active,
       coalesce(extract(epoch FROM now() - r.oldest_ready), 0)::float8 AS oldest_ready_s
  FROM unnest($1::text[]) WITH ORDINALITY AS q(queue, n)
  CROSS JOIN LATERAL (
       SELECT count(*) FILTER (WHERE NOT c.claimed AND c.start_after <= now()) AS ready,
              count(*) FILTER (WHERE NOT c.claimed AND c.start_after > now()) AS delayed,
              count(*) FILTER (WHERE c.claimed) AS active,
              min(c.start_after) FILTER (WHERE NOT c.claimed AND c.start_after <= now())
                  AS oldest_ready
         FROM job_lanes l
         CROSS JOIN LATERAL (
              SELECT j.start_after,
                     (SELECT 1 FROM job_claims k
                       WHERE k.ready_seq = j.ready_seq AND k.job_id = j.id) IS NOT NULL
                         AS claimed
                FROM jobs j
               WHERE j.queue = l.queue AND j.tenant_id = l.tenant_id
                 AND j.priority = l.priority AND j.state IN ('created', 'retry')
                 AND j.ready_seq >= l.floor
                 AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = j.ready_seq) IS NULL
              UNION ALL
              SELECT j.start_after, false
                FROM jobs j
               WHERE j.queue = l.queue AND j.tenant_id = l.tenant_id
                 AND j.priority = l.priority AND j.state IN ('created', 'retry')
                 AND j.start_after > j.created_at AND j.ready_seq < l.floor
                 AND (SELECT 1 FROM job_claims k WHERE k.ready_seq = j.ready_seq) IS NULL) c
        WHERE l.queue = q.queue) r
  CROSS JOIN LATERAL (
       SELECT count(*) AS active
         FROM job_claims a
         JOIN job_lanes l
           ON l.queue = a.queue AND l.tenant_id = a.tenant_id AND l.priority = a.priority
        WHERE a.queue = q.queue
          AND a.lease_expires_at >= (SELECT m.expired_to FROM job_expiry_mark m)
          AND a.ready_seq < l.floor
          AND (SELECT o.ready_seq FROM jobs o
                WHERE o.id = a.job_id AND o.state IN ('created', 'retry')) = a.ready_seq
          AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = a.ready_seq) IS NULL) b
 ORDER BY q.n";

/// How many jobs of one queue wait, and for how long (see [`queue_depths`]).
#[derive(Clone, Debug, PartialEq, diesel::QueryableByName)]
pub struct QueueDepth {
    /// The queue (a stage's queue is its name).
    #[diesel(sql_type = Text)]
    pub queue: String,
    /// Jobs fetchable now: `created` or `retry`, `start_after <= now()`.
    #[diesel(sql_type = BigInt)]
    pub ready: i64,
    /// Jobs waiting for a later `start_after` (deferred, backing off, scheduled).
    #[diesel(sql_type = BigInt)]
    pub delayed: i64,
    /// Jobs leased by a worker (`active`).
    #[diesel(sql_type = BigInt)]
    pub active: i64,
    /// Seconds since the oldest ready job became due (its `start_after`), on the
    /// database's clock; 0 when none is ready.
    #[diesel(sql_type = Double)]
    pub oldest_ready_s: f64,
}

/// The depth of each of `queues`, in their order (a queue without jobs has zeros),
/// in one statement: what a worker samples for its queue gauges. It reads only the
/// live jobs of those queues, through the fetch's and the lease's partial indexes.
pub async fn queue_depths(
    conn: &mut AsyncPgConnection,
    queues: &[String],
) -> Result<Vec<QueueDepth>, RepoError> {
    if queues.is_empty() {
        return Ok(Vec::new());
    }
    let query = diesel::sql_query(QUEUE_DEPTHS_SQL)
        .bind::<Array<Text>, _>(queues)
        .cached();
    crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)
}
