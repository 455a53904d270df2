//! Maintenance (lease expiry, retention) and queue statistics.

use std::sync::LazyLock;
use std::time::Duration;

use diesel::sql_types::{Array, BigInt, Bool, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{JobId, JobState, QueueStats, RepoError};

use super::finish::{
    claim_fence_sql, closure_cte, dead_letter_insert_sql, failure_set_sql, CURRENT_CLAIM_SQL,
    ROW_ENDS_SQL,
};
use super::millis;
use crate::error::map_diesel_error;

/// Advisory lock key of queue maintenance ("idemjobs" in ASCII): one maintainer at
/// a time per database, whichever worker gets there first.
pub const MAINTENANCE_LOCK_KEY: i64 = 0x6964_656d_6a6f_6273;

/// Limits of one [`maintain`] run. The default keeps finished jobs for 7 days and
/// handles at most 10 000 rows per step. Built from the default with the `with_`
/// methods (the struct is `#[non_exhaustive]`):
///
/// ```
/// use std::time::Duration;
/// use idemstage_persistence::queue::MaintenanceConfig;
/// let config = MaintenanceConfig::default().with_retention(Duration::from_secs(3600));
/// assert_eq!(config.batch_limit, 10_000);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct MaintenanceConfig {
    /// Completed, cancelled and failed jobs older than this are deleted.
    pub retention: Duration,
    /// Upper bound of rows expired and of rows deleted per run (keeps runs short);
    /// 0 counts as 1. Expiry looks at up to 100 times as many claims whose
    /// deadline passed (most of them ended before it).
    pub batch_limit: u32,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            retention: Duration::from_secs(7 * 24 * 3600),
            batch_limit: 10_000,
        }
    }
}

impl MaintenanceConfig {
    /// The same, deleting finished jobs older than `retention`.
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The same, handling at most `limit` rows per step.
    pub fn with_batch_limit(mut self, limit: u32) -> Self {
        self.batch_limit = limit;
        self
    }
}

/// What one maintenance run changed, in rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// Active jobs whose lease ran out, put back for a retry.
    pub expired_retried: u64,
    /// Active jobs whose lease ran out with no retries left: now failed.
    pub expired_failed: u64,
    /// Copies sent to dead-letter queues by this run (of `expired_failed` jobs).
    pub dead_lettered: u64,
    /// Finished jobs deleted after their retention.
    pub deleted: u64,
}

/// Whether a [`maintain`] call ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaintenanceOutcome {
    /// This call held the lock and made these changes.
    Ran(MaintenanceReport),
    /// Another session holds the maintenance lock right now.
    Skipped,
}

#[derive(diesel::QueryableByName)]
struct Locked {
    #[diesel(sql_type = Bool)]
    locked: bool,
}

#[derive(diesel::QueryableByName)]
struct ExpiredRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Bool)]
    dead_letter: bool,
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

#[derive(diesel::QueryableByName)]
struct Candidates {
    #[diesel(sql_type = Array<Text>)]
    ids: Vec<String>,
}

/// How many claims expiry may look at per row it may expire (`batch_limit`).
const LOOK_PER_EXPIRY: i64 = 100;

/// Lease expiry, its first statement: binds `$1`, the most claims to look at
/// (int8). The claims whose deadline passed since the mark (`job_expiry_mark`),
/// and those made by a transaction that had not finished at the last run (it may
/// have committed a claim whose deadline was already behind the mark), of which
/// the job's current claim: their jobs' rows locked (waiting for a worker ending
/// or renewing one of them), their ids returned; the mark moved to where the
/// look stopped (the `$1`-th deadline, or now), and to the oldest transaction
/// not finished now.
pub(crate) const EXPIRY_CANDIDATES_SQL: &str = "\
WITH m AS (
    -- Its one row (migration 2026-12-05-130000_expiry_mark_kept refuses its
    -- deletion; a reset starts it over).
    SELECT expired_to, xid_horizon FROM job_expiry_mark
), seen AS (
    SELECT c.ready_seq, c.job_id, c.lease_expires_at
      FROM (SELECT DISTINCT l.queue FROM job_lanes l) q
      CROSS JOIN m
      CROSS JOIN LATERAL (
          SELECT k.ready_seq, k.job_id, k.lease_expires_at FROM job_claims k
           WHERE k.queue = q.queue
             AND k.lease_expires_at >= m.expired_to AND k.lease_expires_at < now()
           ORDER BY k.lease_expires_at
           LIMIT $1) c
     ORDER BY c.lease_expires_at
     LIMIT $1
), late AS (
    SELECT k.ready_seq, k.job_id FROM job_claims k, m
     WHERE k.claim_xid >= m.xid_horizon AND k.lease_expires_at < m.expired_to
), marked AS (
    UPDATE job_expiry_mark
       SET expired_to = CASE WHEN (SELECT count(*) FROM seen) >= $1
                             THEN (SELECT max(lease_expires_at) FROM seen)
                             ELSE now() END,
           xid_horizon = pg_snapshot_xmin(pg_current_snapshot())::text::bigint
    RETURNING 1
), locked AS (
    SELECT j.id FROM jobs j
     WHERE j.id = ANY(ARRAY(SELECT job_id FROM seen UNION SELECT job_id FROM late))
       AND j.state IN ('created', 'retry')
       AND j.ready_seq IN (SELECT ready_seq FROM seen UNION SELECT ready_seq FROM late)
       -- A claim with a closure has ended (a completion writes nothing else).
       AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = j.ready_seq) IS NULL
     ORDER BY j.id
       FOR UPDATE
)
SELECT coalesce(array_agg(locked.id), ARRAY[]::text[]) AS ids FROM locked, (SELECT count(*) FROM marked) x";

/// Lease expiry, its second statement (a new snapshot: it sees what a worker
/// ending or renewing a candidate committed while the first waited for it):
/// binds `$1`, the candidates' ids (text[]). The jobs whose current claim ran
/// out are failed with the rules of `fail` (retry with the job's delay, or
/// failed); returns `(id, state, dead_letter)` of each.
pub(crate) static EXPIRE_SQL: LazyLock<String> = LazyLock::new(|| {
    let fence =
        claim_fence_sql(|_| format!("(SELECT k.lease_expires_at {CURRENT_CLAIM_SQL}) < now()"));
    format!(
        "WITH {closed}, expired AS (
             UPDATE jobs j SET {set},
                    last_error = format('job lease expired: attempt %s not finished within \
                                         expire_in of %s ms',
                                        (SELECT k.attempt {CURRENT_CLAIM_SQL}), j.expire_in_ms)
              WHERE j.id = ANY($1) AND {fence} AND {ROW_ENDS_SQL}
             RETURNING j.id, j.queue, j.state, j.start_after, j.dead_letter
         ), notified AS (
             SELECT count(pg_notify('idemstage_jobs', queue)) AS n FROM (
                 SELECT DISTINCT queue FROM expired
                  WHERE state = 'retry' AND start_after <= now()
             ) q
         )
         SELECT expired.id, expired.state, expired.dead_letter IS NOT NULL AS dead_letter
           FROM expired CROSS JOIN notified",
        closed = closure_cte("'expired'", "NULL", &format!("j.id = ANY($1) AND {fence}")),
        set = failure_set_sql("j.retry_count < j.retry_limit"),
    )
});

/// Retention of closures: binds `$1` the retention (ms), `$2` the batch. The
/// closures closed before it (the oldest first, at most `$2`), their claims, and
/// the rows of the jobs they completed; returns `n`, the jobs deleted.
const CLOSURES_RETENTION_SQL: &str = "\
WITH old AS (
    SELECT z.ready_seq, z.job_id, z.outcome FROM job_closures z
     WHERE z.closed_at < now() - $1 * interval '1 millisecond'
     ORDER BY z.closed_at
     LIMIT $2
), done AS (
    DELETE FROM jobs j
     WHERE j.id = ANY(ARRAY(SELECT job_id FROM old WHERE outcome = 'completed'))
       AND j.ready_seq = ANY(ARRAY(SELECT ready_seq FROM old))
       AND j.state IN ('created', 'retry')
    RETURNING 1
), claims AS (
    DELETE FROM job_claims k WHERE k.ready_seq = ANY(ARRAY(SELECT ready_seq FROM old))
), closures AS (
    DELETE FROM job_closures z WHERE z.ready_seq = ANY(ARRAY(SELECT ready_seq FROM old))
)
SELECT count(*) AS n FROM done";

/// One maintenance run in one transaction, under `pg_try_advisory_xact_lock` (a
/// concurrent run is `Skipped`, not waited for): expired leases are failed with the
/// rules of `fail` (retry with the job's delay, or failed and dead-lettered), then
/// finished jobs past the retention are deleted. Runs as the connecting user,
/// across tenants. Call it outside a transaction: inside one, the lock and the
/// changes last until the caller's transaction ends.
pub async fn maintain(
    conn: &mut AsyncPgConnection,
    config: &MaintenanceConfig,
) -> Result<MaintenanceOutcome, RepoError> {
    let limit = i64::from(config.batch_limit.max(1));
    let retention_ms = millis(config.retention);
    conn.transaction::<_, diesel::result::Error, _>(async move |conn| {
        // A worker stopped (SIGSTOP, VM pause) inside this transaction would hold the
        // lock, and so stop every worker's maintenance (expired job leases would
        // never come back): the server ends such a session after the timeout.
        // No JIT: the expiry's estimated cost passes `jit_above_cost` (its
        // looks are bounded by a LIMIT the planner does not believe), and the
        // server compiled it on every run, 300 ms of CPU for a statement of
        // a few milliseconds.
        let lock: Locked = diesel::sql_query(
            "SELECT pg_try_advisory_xact_lock($1) AS locked
               FROM (SELECT set_config('idle_in_transaction_session_timeout', $2, true),
                            set_config('jit', 'off', true)) s",
        )
        .bind::<BigInt, _>(MAINTENANCE_LOCK_KEY)
        .bind::<diesel::sql_types::Text, _>(
            crate::tenant::IDLE_IN_TRANSACTION_TIMEOUT_MS.to_string(),
        )
        .get_result(conn)
        .await?;
        if !lock.locked {
            return Ok(MaintenanceOutcome::Skipped);
        }
        let mut report = MaintenanceReport::default();

        // Most claims whose deadline passed ended long before it (a lease is
        // as long as the job may take): the look reaches far more claims than
        // it expires, so its bound is a hundred times the batch's, lest the
        // mark fall behind a queue that finishes more than a batch a run.
        let candidates: Candidates = diesel::sql_query(EXPIRY_CANDIDATES_SQL)
            .bind::<BigInt, _>(limit.saturating_mul(LOOK_PER_EXPIRY))
            .get_result(conn)
            .await?;
        let expired: Vec<ExpiredRow> = if candidates.ids.is_empty() {
            Vec::new()
        } else {
            diesel::sql_query(EXPIRE_SQL.as_str())
                .bind::<Array<Text>, _>(&candidates.ids)
                .load(conn)
                .await?
        };
        let mut to_dead_letter = Vec::new();
        for row in &expired {
            if row.state == JobState::Retry.as_str() {
                report.expired_retried += 1;
            } else {
                report.expired_failed += 1;
                if row.dead_letter {
                    to_dead_letter.push(row.id.clone());
                }
            }
        }

        if !to_dead_letter.is_empty() {
            // Ids are ULIDs generated here; the copy is made in the same transaction
            // as the failure, so neither exists without the other.
            let new_ids: Vec<String> = to_dead_letter
                .iter()
                .map(|_| JobId::new().to_string())
                .collect();
            let dl_sql = format!(
                "WITH src AS (
                     SELECT j.*, t.new_id FROM jobs j
                       JOIN unnest($1::text[], $2::text[]) AS t(src_id, new_id) ON j.id = t.src_id
                 ), dl AS (
                     {dl}
                 ), notified AS (
                     SELECT count(pg_notify('idemstage_jobs', queue)) AS n
                       FROM (SELECT DISTINCT queue FROM dl) q
                 )
                 SELECT (SELECT count(*) FROM dl) AS n FROM notified",
                dl = dead_letter_insert_sql("src.new_id", "src", ""),
            );
            let copied: Count = diesel::sql_query(dl_sql)
                .bind::<Array<Text>, _>(&to_dead_letter)
                .bind::<Array<Text>, _>(&new_ids)
                .get_result(conn)
                .await?;
            report.dead_lettered = u64::try_from(copied.n).unwrap_or(0);
        }

        let deleted = diesel::sql_query(
            // The conditions again outside: a row changed after this statement's
            // snapshot (a failed job retried by hand) is re-checked in its new
            // version, and the IN alone would match it by id.
            "DELETE FROM jobs WHERE id IN (
                 SELECT id FROM jobs
                  WHERE state IN ('completed', 'cancelled', 'failed')
                    AND completed_at < now() - $1 * interval '1 millisecond'
                  LIMIT $2)
               AND state IN ('completed', 'cancelled', 'failed')
               AND completed_at < now() - $1 * interval '1 millisecond'",
        )
        .bind::<BigInt, _>(retention_ms)
        .bind::<BigInt, _>(limit)
        .execute(conn)
        .await?;
        // Closures after the retention, with their claims and the rows of the
        // jobs they completed (such a row is still `created` or `retry` and
        // names the claim), in one statement: a job's ready entry never has
        // its claim without its closure, or neither (it would be fetched again).
        let closed: Count = diesel::sql_query(CLOSURES_RETENTION_SQL)
            .bind::<BigInt, _>(retention_ms)
            .bind::<BigInt, _>(limit)
            .get_result(conn)
            .await?;
        // Claims after the retention, by deadline: one behind the expiry mark
        // has ended (expiry took it back if nothing else ended it), so nothing
        // reads it but a view of a job that is gone or ended long ago. A claim
        // with a closure goes with its closure (above).
        diesel::sql_query(
            "DELETE FROM job_claims WHERE ready_seq IN (
                 SELECT c.ready_seq
                   FROM (SELECT DISTINCT l.queue FROM job_lanes l) q
                   CROSS JOIN LATERAL (
                       SELECT k.ready_seq FROM job_claims k
                        WHERE k.queue = q.queue
                          AND k.lease_expires_at < least(
                                  now() - $1 * interval '1 millisecond',
                                  (SELECT m.expired_to FROM job_expiry_mark m))
                          AND (SELECT 1 FROM job_closures z WHERE z.ready_seq = k.ready_seq) IS NULL
                        ORDER BY k.lease_expires_at
                        LIMIT $2) c
                  LIMIT $2)",
        )
        .bind::<BigInt, _>(retention_ms)
        .bind::<BigInt, _>(limit)
        .execute(conn)
        .await?;
        report.deleted = deleted as u64 + u64::try_from(closed.n).unwrap_or(0);
        Ok(MaintenanceOutcome::Ran(report))
    })
    .await
    .map_err(map_diesel_error)
}

#[derive(diesel::QueryableByName)]
struct StatRow {
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Job counts per queue and state, of every queue (`jobs` has no tenant).
pub async fn queue_stats(conn: &mut AsyncPgConnection) -> Result<QueueStats, RepoError> {
    let query = diesel::sql_query(
        "SELECT queue, state, count(*) AS n FROM job_states GROUP BY queue, state ORDER BY queue, state",
    );
    let rows: Vec<StatRow> = crate::db::pinned(conn, async move |conn| query.load(conn).await)
        .await
        .map_err(map_diesel_error)?;
    let mut stats = QueueStats::default();
    for row in rows {
        let state = JobState::parse(&row.state).ok_or_else(|| {
            RepoError::Database(format!("unknown job state {:?} in jobs", row.state).into())
        })?;
        *stats.queues.entry(row.queue).or_default().get_mut(state) += row.n;
    }
    Ok(stats)
}
