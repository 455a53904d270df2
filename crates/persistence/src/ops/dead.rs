//! `dead`: the dead-letter list, dead stages and failed jobs with their last errors.

use chrono::{DateTime, Utc};
use diesel::sql_types::{BigInt, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, JobId, RunId, StageName, TenantId};
use serde::Serialize;

use super::OpsError;

/// Which dead letters [`dead`] lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadFilter {
    /// Only this tenant's (read in a transaction scoped to it); `None`: every
    /// tenant's, as the connecting user sees them.
    pub tenant: Option<TenantId>,
    /// Only this stage's (and its queue's jobs).
    pub stage: Option<StageName>,
    /// At most this many of each list, newest first; `None`: 1,000.
    pub limit: Option<u32>,
}

/// One dead stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadStage {
    /// The tenant.
    pub tenant: TenantId,
    /// The item.
    pub item: ItemId,
    /// The stage.
    pub stage: StageName,
    /// Its run.
    pub run_id: RunId,
    /// Attempts it used.
    pub attempts: i32,
    /// Its budget.
    pub max_attempts: i32,
    /// The worker of its last attempt.
    pub worker_id: String,
    /// When it died (database clock).
    pub finished_at: Option<DateTime<Utc>>,
    /// Its last error (sanitised): what it died of.
    pub last_error: Option<String>,
}

/// One job that failed for good.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FailedJob {
    /// The job.
    pub id: JobId,
    /// Its queue.
    pub queue: String,
    /// The tenant it worked for (`None`: a job of no tenant).
    pub tenant: Option<String>,
    /// The item its payload names, if any (as written there).
    pub item: Option<String>,
    /// Deliveries.
    pub attempt: i32,
    /// Retryable failures counted.
    pub retry_count: i32,
    /// When it failed.
    pub completed_at: Option<DateTime<Utc>>,
    /// Its last error.
    pub last_error: Option<String>,
}

/// The dead-letter list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeadLetters {
    /// Dead stages, newest first.
    pub stages: Vec<DeadStage>,
    /// Failed jobs (state `failed`), newest first, until their retention ends.
    pub jobs: Vec<FailedJob>,
}

#[derive(QueryableByName)]
struct DeadRow {
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = Text)]
    item_id: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Integer)]
    max_attempts: i32,
    #[diesel(sql_type = Text)]
    worker_id: String,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    finished_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

#[derive(QueryableByName)]
struct FailedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    tenant_id: String,
    #[diesel(sql_type = Nullable<Text>)]
    item: Option<String>,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Integer)]
    retry_count: i32,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    completed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

/// `$1` tenant or NULL, `$2` stage or NULL, `$3` limit.
const DEAD_SQL: &str = "\
SELECT tenant_id, item_id, stage, id, attempts, max_attempts, worker_id, finished_at,
       last_error
  FROM stage_runs
 WHERE status = 'dead' AND ($1::text IS NULL OR tenant_id = $1)
   AND ($2::text IS NULL OR stage = $2)
 ORDER BY finished_at DESC NULLS LAST, id DESC
 LIMIT $3";

/// `$1` tenant or NULL, `$2` queue or NULL, `$3` limit.
const FAILED_JOBS_SQL: &str = "\
SELECT id, queue, tenant_id, payload->>'item_id' AS item, attempt, retry_count,
       completed_at, last_error
  FROM job_states
 WHERE state = 'failed' AND ($1::text IS NULL OR tenant_id = $1)
   AND ($2::text IS NULL OR queue = $2)
 ORDER BY completed_at DESC NULLS LAST, id DESC
 LIMIT $3";

/// The dead-letter list: dead stages (`stage_runs.status = 'dead'`) and
/// failed jobs, each with its last error, newest first. With a tenant, read in a
/// transaction scoped to it; without, across tenants as the connecting user
/// (an operator's read, like `idemstage status`). Read-only.
pub async fn dead(
    conn: &mut AsyncPgConnection,
    filter: &DeadFilter,
) -> Result<DeadLetters, OpsError> {
    let limit = i64::from(filter.limit.unwrap_or(1000));
    let tenant = filter.tenant.as_ref().map(|t| t.as_str().to_owned());
    let stage = filter.stage.as_ref().map(|s| s.as_str().to_owned());
    let (runs, jobs) = conn
        .transaction::<_, OpsError, _>(async |conn| {
            if let Some(t) = &filter.tenant {
                crate::tenant::scope(conn, t).await?;
            }
            let runs: Vec<DeadRow> = diesel::sql_query(DEAD_SQL)
                .bind::<Nullable<Text>, _>(tenant.as_deref())
                .bind::<Nullable<Text>, _>(stage.as_deref())
                .bind::<BigInt, _>(limit)
                .load(conn)
                .await?;
            let jobs: Vec<FailedRow> = diesel::sql_query(FAILED_JOBS_SQL)
                .bind::<Nullable<Text>, _>(tenant.as_deref())
                .bind::<Nullable<Text>, _>(stage.as_deref())
                .bind::<BigInt, _>(limit)
                .load(conn)
                .await?;
            Ok((runs, jobs))
        })
        .await?;
    let stages = runs
        .into_iter()
        .map(|r| {
            Ok(DeadStage {
                tenant: TenantId::parse(&r.tenant_id)?,
                item: ItemId::parse(&r.item_id)?,
                stage: StageName::parse(&r.stage)?,
                run_id: RunId::parse(&r.id)?,
                attempts: r.attempts,
                max_attempts: r.max_attempts,
                worker_id: r.worker_id,
                finished_at: r.finished_at,
                last_error: r.last_error,
            })
        })
        .collect::<Result<Vec<_>, OpsError>>()?;
    let jobs = jobs
        .into_iter()
        .map(|j| {
            Ok(FailedJob {
                id: JobId::parse(&j.id)?,
                queue: j.queue,
                tenant: (!j.tenant_id.is_empty()).then_some(j.tenant_id),
                item: j.item,
                attempt: j.attempt,
                retry_count: j.retry_count,
                completed_at: j.completed_at,
                last_error: j.last_error,
            })
        })
        .collect::<Result<Vec<_>, OpsError>>()?;
    Ok(DeadLetters { stages, jobs })
}
