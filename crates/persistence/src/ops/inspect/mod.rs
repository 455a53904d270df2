//! `inspect`: the timeline of one item, read-only.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Bool, Integer, Nullable, Text, Timestamptz};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{ItemId, JobId, RunId, RunStatus, StageName, TenantId};
use serde::Serialize;

use super::OpsError;

mod fan_outs;

pub use fan_outs::{ChildOf, ChildView, FanOutView};

/// Everything the database knows about one item's run through its pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ItemTimeline {
    /// The tenant.
    pub tenant: TenantId,
    /// The item.
    pub item: ItemId,
    /// SHA-256 (hex) of its stored input.
    pub input_sha256: String,
    /// When it was registered (database clock).
    pub created_at: DateTime<Utc>,
    /// The database clock when this was read (to judge the leases by).
    pub read_at: DateTime<Utc>,
    /// Its stages that have a run, in the order they were first claimed.
    pub stages: Vec<StageTimeline>,
    /// Its jobs (payload naming its tenant and id), oldest first, of every
    /// state; finished ones are deleted after their retention.
    pub jobs: Vec<JobView>,
    /// For a child of a fan-out: its parent and its place there.
    pub child_of: Option<ChildOf>,
    /// The fan-outs its stages' successes wrote, oldest first, each with its
    /// children.
    pub fan_outs: Vec<FanOutView>,
}

/// One stage's run and its attempts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct StageTimeline {
    /// The stage.
    pub stage: StageName,
    /// Its run.
    pub run_id: RunId,
    /// The run's status.
    pub status: RunStatus,
    /// Attempts claimed so far.
    pub attempts: i32,
    /// Its attempt budget.
    pub max_attempts: i32,
    /// The attempt whose results are current, if any.
    pub success_attempt: Option<i32>,
    /// The stage the latest attempt read from (`None`: the first stage, which
    /// reads the item's input).
    pub upstream_stage: Option<StageName>,
    /// That stage's successful attempt the latest attempt read.
    pub upstream_attempt: Option<i32>,
    /// The latest attempt's lease end (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// `running` with a lease that has not run out: a worker holds it.
    pub lease_live: bool,
    /// The run's last error (sanitised).
    pub last_error: Option<String>,
    /// While it is `waiting`: what for and until when.
    pub wait: Option<WaitView>,
    /// Every attempt, in order.
    pub attempts_history: Vec<AttemptView>,
}

/// What a waiting stage waits for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WaitView {
    /// The signal (`None`: a timer).
    pub signal: Option<StageName>,
    /// The deadline (database clock).
    pub until: DateTime<Utc>,
    /// What the deadline does: `fail` or `resume`.
    pub on_timeout: String,
}

/// One attempt of a stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AttemptView {
    /// Its number (the fencing token).
    pub attempt: i32,
    /// The worker that claimed it.
    pub worker_id: String,
    /// When it was claimed.
    pub started_at: DateTime<Utc>,
    /// When it ended, if it did.
    pub finished_at: Option<DateTime<Utc>>,
    /// `running`, `success`, `failed`, `abandoned`, `fenced`, `cancelled` or
    /// `waiting`.
    pub outcome: String,
    /// Its error (sanitised).
    pub error: Option<String>,
    /// SHA-256 (hex) of the input it was bound to.
    pub input_hash: String,
    /// The upstream's successful attempt it read (`None` for the first stage).
    pub upstream_attempt: Option<i32>,
    /// The lease, for the run's latest attempt only (earlier attempts' leases are
    /// not kept).
    pub lease_expires_at: Option<DateTime<Utc>>,
}

/// One job of the item.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct JobView {
    /// The job.
    pub id: JobId,
    /// Its queue (a stage's queue is its name).
    pub queue: String,
    /// `created`, `retry`, `active`, `completed`, `cancelled` or `failed`.
    pub state: String,
    /// Deliveries so far (the job lease's fencing token).
    pub attempt: i32,
    /// Retryable failures counted so far.
    pub retry_count: i32,
    /// Failures allowed before it fails for good.
    pub retry_limit: i32,
    /// Not fetched before this (its next run, while `created` or `retry`).
    pub start_after: DateTime<Utc>,
    /// The end of its job lease while `active`.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// When it was completed, cancelled or failed.
    pub completed_at: Option<DateTime<Utc>>,
    /// When it was sent.
    pub created_at: DateTime<Utc>,
    /// Its last error.
    pub last_error: Option<String>,
}

#[derive(QueryableByName)]
struct ItemRow {
    #[diesel(sql_type = Text)]
    input_sha256: String,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Timestamptz)]
    read_at: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct RunRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Integer)]
    max_attempts: i32,
    #[diesel(sql_type = Nullable<Integer>)]
    success_attempt: Option<i32>,
    #[diesel(sql_type = Nullable<Text>)]
    upstream_stage: Option<String>,
    #[diesel(sql_type = Nullable<Integer>)]
    upstream_attempt: Option<i32>,
    #[diesel(sql_type = Timestamptz)]
    lease_expires_at: DateTime<Utc>,
    #[diesel(sql_type = Bool)]
    lease_live: bool,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    wait_signal: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    wait_until: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    wait_on_timeout: Option<String>,
}

#[derive(QueryableByName)]
struct AttemptRow {
    #[diesel(sql_type = Text)]
    run_id: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Text)]
    worker_id: String,
    #[diesel(sql_type = Timestamptz)]
    started_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    finished_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Text)]
    outcome: String,
    #[diesel(sql_type = Nullable<Text>)]
    error: Option<String>,
    #[diesel(sql_type = Text)]
    input_hash: String,
    #[diesel(sql_type = Nullable<Integer>)]
    upstream_attempt: Option<i32>,
}

#[derive(QueryableByName)]
struct JobRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = Integer)]
    attempt: i32,
    #[diesel(sql_type = Integer)]
    retry_count: i32,
    #[diesel(sql_type = Integer)]
    retry_limit: i32,
    #[diesel(sql_type = Timestamptz)]
    start_after: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    lease_expires_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    completed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

const ITEM_SQL: &str = "\
SELECT input_sha256, created_at, clock_timestamp() AS read_at
  FROM items WHERE tenant_id = $1 AND id = $2";

const RUNS_SQL: &str = "\
SELECT r.id, r.stage, r.status, r.attempts, r.max_attempts, r.success_attempt, r.upstream_stage,
       r.upstream_attempt, r.lease_expires_at,
       (r.status = 'running' AND r.lease_expires_at >= clock_timestamp()) AS lease_live,
       r.last_error, w.signal AS wait_signal, w.wait_until, w.on_timeout AS wait_on_timeout
  FROM stage_runs r
  LEFT JOIN stage_waits w
         ON r.status = 'waiting' AND w.run_id = r.id AND w.attempt = r.attempts
 WHERE r.tenant_id = $1 AND r.item_id = $2
 ORDER BY r.created_at, r.id";

const ATTEMPTS_SQL: &str = "\
SELECT a.run_id, a.attempt, a.worker_id, a.started_at, a.finished_at, a.outcome, a.error,
       a.input_hash, a.upstream_attempt
  FROM stage_run_attempts a JOIN stage_runs r ON r.id = a.run_id
 WHERE r.tenant_id = $1 AND r.item_id = $2
 ORDER BY a.run_id, a.attempt";

/// A stage job's payload names its tenant and item (`StageJob`). `jobs` has
/// no row-level security: the tenant is named here.
pub(super) const JOBS_OF_ITEM: &str = "payload->>'tenant_id' = $1 AND payload->>'item_id' = $2";

/// The timeline of one item: every run of it with every attempt (worker,
/// start and end, the lease of the live one, outcome, error, the upstream
/// attempt it read) and every job whose payload names it (state, deliveries,
/// next run). Read-only, in one transaction scoped to `tenant` (so one
/// consistent snapshot per statement of the tenant's rows only). An unknown
/// item (or one of another tenant) is `ItemNotFound`.
///
/// The jobs are found by their payload (`tenant_id`, `item_id`), which scans
/// the jobs table: an operator's read, not a worker's.
pub async fn inspect(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
) -> Result<ItemTimeline, OpsError> {
    let (head, runs, attempts, jobs, (child_of, fan_outs)) =
        crate::tenant::transaction::<_, OpsError, _>(conn, tenant, async |conn| {
            let bind = |sql: &'static str| {
                diesel::sql_query(sql)
                    .bind::<Text, _>(tenant.as_str().to_owned())
                    .bind::<Text, _>(item.to_string())
            };
            let head: Option<ItemRow> =
                bind(ITEM_SQL)
                    .get_result(conn)
                    .await
                    .map(Some)
                    .or_else(|e| match e {
                        diesel::result::Error::NotFound => Ok(None),
                        e => Err(e),
                    })?;
            let Some(head) = head else {
                return Err(OpsError::ItemNotFound {
                    tenant: tenant.clone(),
                    item: *item,
                });
            };
            let runs: Vec<RunRow> = bind(RUNS_SQL).load(conn).await?;
            let attempts: Vec<AttemptRow> = bind(ATTEMPTS_SQL).load(conn).await?;
            let jobs_sql = format!(
                "SELECT id, queue, state, attempt, retry_count, retry_limit, start_after, \
                        lease_expires_at, completed_at, created_at, last_error \
                   FROM job_states WHERE {JOBS_OF_ITEM} ORDER BY created_at, id"
            );
            let jobs: Vec<JobRow> = diesel::sql_query(jobs_sql)
                .bind::<Text, _>(tenant.as_str())
                .bind::<Text, _>(item.to_string())
                .load(conn)
                .await?;
            let fan_outs = fan_outs::read(conn, tenant, item).await?;
            Ok((head, runs, attempts, jobs, fan_outs))
        })
        .await?;

    let mut stages = Vec::with_capacity(runs.len());
    for r in runs {
        let history = attempts
            .iter()
            .filter(|a| a.run_id == r.id)
            .map(|a| AttemptView {
                attempt: a.attempt,
                worker_id: a.worker_id.clone(),
                started_at: a.started_at,
                finished_at: a.finished_at,
                outcome: a.outcome.clone(),
                error: a.error.clone(),
                input_hash: a.input_hash.clone(),
                upstream_attempt: a.upstream_attempt,
                lease_expires_at: (a.attempt == r.attempts).then_some(r.lease_expires_at),
            })
            .collect();
        stages.push(StageTimeline {
            stage: StageName::parse(&r.stage)?,
            run_id: RunId::parse(&r.id)?,
            status: r.status.parse()?,
            attempts: r.attempts,
            max_attempts: r.max_attempts,
            success_attempt: r.success_attempt,
            upstream_stage: r
                .upstream_stage
                .as_deref()
                .map(StageName::parse)
                .transpose()?,
            upstream_attempt: r.upstream_attempt,
            lease_expires_at: r.lease_expires_at,
            lease_live: r.lease_live,
            last_error: r.last_error,
            wait: match (r.wait_until, r.wait_on_timeout) {
                (Some(until), Some(on_timeout)) => Some(WaitView {
                    signal: r.wait_signal.as_deref().map(StageName::parse).transpose()?,
                    until,
                    on_timeout,
                }),
                _ => None,
            },
            attempts_history: history,
        });
    }
    let jobs = jobs
        .into_iter()
        .map(|j| {
            Ok(JobView {
                id: JobId::parse(&j.id)?,
                queue: j.queue,
                state: j.state,
                attempt: j.attempt,
                retry_count: j.retry_count,
                retry_limit: j.retry_limit,
                start_after: j.start_after,
                lease_expires_at: j.lease_expires_at,
                completed_at: j.completed_at,
                created_at: j.created_at,
                last_error: j.last_error,
            })
        })
        .collect::<Result<Vec<_>, OpsError>>()?;
    Ok(ItemTimeline {
        tenant: tenant.clone(),
        item: *item,
        input_sha256: head.input_sha256,
        created_at: head.created_at,
        read_at: head.read_at,
        stages,
        jobs,
        child_of,
        fan_outs,
    })
}
