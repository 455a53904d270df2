//! `cancel`: an item's live jobs cancelled, its unfinished stages `cancelled`.

use diesel::sql_types::{Array, Bool, Integer, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::stage_singleton_key;
use idemstage_domain::{BulkId, ItemId, JobId, RunId, RunStatus, StageName, TenantId};
use serde::Serialize;

use super::inspect::JOBS_OF_ITEM;
use super::{audit, stored_hash, Actor, OpsError};

/// What a cancelled stage was before.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum CancelledFrom {
    /// Running: its attempt is fenced (its commit, renewal, failure and release
    /// are refused) and recorded `cancelled`.
    Running {
        /// The fenced attempt.
        attempt: i32,
        /// Whether its lease was still live (a worker was holding it).
        lease_live: bool,
    },
    /// Failed, waiting for its next attempt.
    Failed,
    /// Invalidated by its upstream's new success, waiting to run again.
    Stale,
    /// Waiting for a signal or a timer: the wait ends unanswered (a later
    /// delivery is refused).
    Waiting,
    /// It had no run, only a live job: its run was created `cancelled`, so no
    /// later job can claim it.
    Queued,
    /// The first stage had succeeded and its rerun on another input was queued
    /// (its live job carries another input hash): the rerun never runs, and the results of its
    /// success stay current (`success_attempt` kept), as for a rerun cancelled
    /// while running.
    RerunQueued,
}

/// One stage the cancel ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CancelledStage {
    /// The stage.
    pub stage: StageName,
    /// Its run, now `cancelled`.
    pub run_id: RunId,
    /// What it was.
    pub from: CancelledFrom,
}

/// One job the cancel ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CancelledJob {
    /// The job.
    pub id: JobId,
    /// Its queue.
    pub queue: String,
    /// Its state before: `created`, `retry` or `active` (held by a worker, whose
    /// completion of it is then fenced).
    pub state: String,
}

/// What [`cancel`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum CancelOutcome {
    /// Something was cancelled (at least one stage or job).
    Cancelled {
        /// The stages that ended `cancelled`.
        stages: Vec<CancelledStage>,
        /// The jobs that ended `cancelled`.
        jobs: Vec<CancelledJob>,
    },
    /// Every stage was final already and no job was live: nothing changed (a
    /// second cancel, or one of a finished item).
    NothingToCancel,
}

#[derive(QueryableByName)]
struct LockedRun {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Bool)]
    lease_live: bool,
}

#[derive(QueryableByName)]
struct CancelledJobRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    queue: String,
    #[diesel(sql_type = Text)]
    state: String,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    singleton_key: Option<String>,
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    input_hash: Option<String>,
}

#[derive(QueryableByName)]
struct InsertedRun {
    #[diesel(sql_type = Text)]
    id: String,
}

/// Every run of the item, locked in the order the runs were created: a
/// downstream run is created after its upstream succeeded, so this is
/// upstream-first, the order of the fenced completion's locks (share on the
/// upstream, then its own row).
const LOCK_RUNS_SQL: &str = "\
SELECT id, stage, status, attempts,
       (status = 'running' AND lease_expires_at >= clock_timestamp()) AS lease_live
  FROM stage_runs
 WHERE tenant_id = $1 AND item_id = $2 AND ($3::text IS NULL OR stage = $3)
 ORDER BY created_at, id
   FOR UPDATE";

/// The unfinished runs among the locked ones end `cancelled`. `$1` tenant, `$2`
/// item, `$3` run ids, `$4` the reason.
const CANCEL_RUNS_SQL: &str = "\
UPDATE stage_runs
   SET status = 'cancelled', finished_at = clock_timestamp(), last_error = $4,
       lease_expires_at = least(lease_expires_at, clock_timestamp())
 WHERE tenant_id = $1 AND item_id = $2 AND id = ANY($3::text[])
   AND status IN ('running', 'failed', 'stale', 'waiting')";

/// A first stage's success whose live job carries another input (a rerun sent,
/// not yet claimed) ends `cancelled`; its `success_attempt` stays, so what was
/// computed from it stays current. Only the first stage (no `upstream_stage`):
/// a later stage binds its upstream's success, whatever hash its job names. The
/// row is locked above. `$1` tenant, `$2` item, `$3` stage, `$4` the job's
/// input hash, `$5` the reason.
const CANCEL_QUEUED_RERUN_SQL: &str = "\
UPDATE stage_runs
   SET status = 'cancelled', finished_at = clock_timestamp(), last_error = $5
 WHERE tenant_id = $1 AND item_id = $2 AND stage = $3
   AND status = 'success' AND upstream_stage IS NULL AND input_hash IS DISTINCT FROM $4
RETURNING id";

/// A stage that had only a job: its run is created `cancelled` (attempt 1,
/// recorded `cancelled` by the attempt trigger). No row back: a claim created the
/// run since the lock above, and it is locked and cancelled like the others.
/// `$1` new run id, `$2` tenant, `$3` item, `$4` stage, `$5` worker (the
/// operator), `$6` reason.
const CANCEL_QUEUED_SQL: &str = "\
INSERT INTO stage_runs
    (id, tenant_id, item_id, stage, status, attempts, max_attempts, input_hash,
     worker_id, started_at, lease_expires_at, finished_at, last_error)
SELECT $1, a.tenant_id, a.id, $4, 'cancelled', 1, 1, a.input_sha256, $5,
       clock_timestamp(), clock_timestamp(), clock_timestamp(), $6
  FROM items a WHERE a.tenant_id = $2 AND a.id = $3
ON CONFLICT (tenant_id, item_id, stage) DO NOTHING
RETURNING id";

/// Cancels the item: every live job whose payload names it ends `cancelled`
/// (a worker holding one is fenced on its job lease), and every stage of it that
/// is not final (`running`, `failed`, `stale`, or with only a queued job) ends
/// `cancelled`, a final status no claim takes: a running attempt's commit is
/// refused by the fence (`Fenced`), and nothing of it is written. A success whose
/// rerun on another input is queued ends `cancelled` too (its results stay
/// current). Other final stages (`success`, `dead`) stay as they are, and so do
/// their results.
///
/// One transaction scoped to `tenant`, with its `audit_log` entry
/// (`operator.cancel`, with `actor`): it locks the item's runs upstream-first
/// (a stage committing right now finishes first, and its next job is then found
/// and cancelled), cancels the jobs, then the stages. `ItemNotFound` for an
/// unknown item; `NothingToCancel` (nothing written) when everything was final
/// already.
pub async fn cancel(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    actor: &Actor,
) -> Result<CancelOutcome, OpsError> {
    let mut tries = 0;
    loop {
        let result = crate::tenant::transaction::<_, OpsError, _>(conn, tenant, async |conn| {
            cancel_in(conn, tenant, item, actor, None).await
        })
        .await;
        if !super::again_after(&result, &mut tries).await {
            return result;
        }
    }
}

/// [`cancel`] in the caller's transaction (scoped to `tenant`); `bulk` names the
/// bulk action it is part of, in the audit entry.
pub(super) async fn cancel_in(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    actor: &Actor,
    bulk: Option<&BulkId>,
) -> Result<CancelOutcome, OpsError> {
    stored_hash(conn, tenant, item).await?;
    let reason = format!("cancelled by {actor}");
    let (mut stages, had_run) = cancel_runs(conn, tenant, item, None, &reason).await?;
    // A statement of its own, so a snapshot after the locks above: a job sent by
    // a commit they waited for is seen.
    let jobs_sql = format!(
        "WITH live AS ( \
             SELECT id, state FROM jobs \
              WHERE state IN ('created', 'retry', 'active') AND {JOBS_OF_ITEM} \
              ORDER BY id FOR UPDATE) \
         UPDATE jobs j SET state = 'cancelled', completed_at = now(), \
                lease_expires_at = NULL, last_error = $3 \
           FROM live WHERE j.id = live.id \
         RETURNING j.id, j.queue, live.state, j.singleton_key, \
                   j.payload->>'input_hash' AS input_hash"
    );
    let cancelled_jobs: Vec<CancelledJobRow> = diesel::sql_query(jobs_sql)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(&reason)
        .load(conn)
        .await?;
    // Stages whose job was live but that had no run: they get one, `cancelled`.
    let worker = format!("operator:{actor}");
    for j in &cancelled_jobs {
        let Ok(stage) = StageName::parse(&j.queue) else {
            continue; // not a stage's queue
        };
        if j.singleton_key.as_deref() != Some(&stage_singleton_key(&stage, tenant, item)) {
            continue; // not the stage's own job
        }
        if had_run.contains(&stage) {
            // A first stage's success whose rerun on another input was queued: the
            // rerun is what the cancel stops, so the stage ends cancelled (results
            // kept).
            let rerun: Vec<InsertedRun> = diesel::sql_query(CANCEL_QUEUED_RERUN_SQL)
                .bind::<Text, _>(tenant.as_str())
                .bind::<Text, _>(item.to_string())
                .bind::<Text, _>(stage.as_str())
                .bind::<diesel::sql_types::Nullable<Text>, _>(j.input_hash.as_deref())
                .bind::<Text, _>(&reason)
                .load(conn)
                .await?;
            if let Some(row) = rerun.into_iter().next() {
                stages.push(CancelledStage {
                    stage,
                    run_id: RunId::parse(&row.id)?,
                    from: CancelledFrom::RerunQueued,
                });
            }
            continue;
        }
        let inserted: Vec<InsertedRun> = diesel::sql_query(CANCEL_QUEUED_SQL)
            .bind::<Text, _>(RunId::new().to_string())
            .bind::<Text, _>(tenant.as_str())
            .bind::<Text, _>(item.to_string())
            .bind::<Text, _>(stage.as_str())
            .bind::<Text, _>(&worker)
            .bind::<Text, _>(&reason)
            .load(conn)
            .await?;
        match inserted.into_iter().next() {
            Some(row) => stages.push(CancelledStage {
                stage,
                run_id: RunId::parse(&row.id)?,
                from: CancelledFrom::Queued,
            }),
            None => {
                // A worker that had fetched the job claimed it after the lock.
                let (more, _) = cancel_runs(conn, tenant, item, Some(&stage), &reason).await?;
                stages.extend(more);
            }
        }
    }
    if stages.is_empty() && cancelled_jobs.is_empty() {
        return Ok(CancelOutcome::NothingToCancel);
    }
    let jobs = cancelled_jobs
        .into_iter()
        .map(|j| {
            Ok(CancelledJob {
                id: JobId::parse(&j.id)?,
                queue: j.queue,
                state: j.state,
            })
        })
        .collect::<Result<Vec<_>, OpsError>>()?;
    let details = serde_json::json!({ "actor": actor, "stages": stages, "jobs": jobs });
    audit(conn, tenant, item, "operator.cancel", details, bulk).await?;
    Ok(CancelOutcome::Cancelled { stages, jobs })
}

/// Locks the item's runs (or one stage's), upstream-first, and cancels the
/// unfinished ones. Returns those and the stages that have a run.
async fn cancel_runs(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: Option<&StageName>,
    reason: &str,
) -> Result<(Vec<CancelledStage>, Vec<StageName>), OpsError> {
    let locked: Vec<LockedRun> = diesel::sql_query(LOCK_RUNS_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<diesel::sql_types::Nullable<Text>, _>(stage.map(|s| s.as_str()))
        .load(conn)
        .await?;
    let mut cancelled = Vec::new();
    let mut ids = Vec::new();
    let mut had_run = Vec::with_capacity(locked.len());
    for r in &locked {
        let name = StageName::parse(&r.stage)?;
        had_run.push(name.clone());
        let from = match r.status.parse::<RunStatus>()? {
            RunStatus::Running => CancelledFrom::Running {
                attempt: r.attempts,
                lease_live: r.lease_live,
            },
            RunStatus::Failed => CancelledFrom::Failed,
            RunStatus::Stale => CancelledFrom::Stale,
            RunStatus::Waiting => CancelledFrom::Waiting,
            RunStatus::Success | RunStatus::Dead | RunStatus::Cancelled => continue,
        };
        ids.push(r.id.clone());
        cancelled.push(CancelledStage {
            stage: name,
            run_id: RunId::parse(&r.id)?,
            from,
        });
    }
    if !ids.is_empty() {
        // The rows are locked: the status they were read with is still theirs.
        diesel::sql_query(CANCEL_RUNS_SQL)
            .bind::<Text, _>(tenant.as_str())
            .bind::<Text, _>(item.to_string())
            .bind::<Array<Text>, _>(&ids)
            .bind::<Text, _>(reason)
            .execute(conn)
            .await?;
    }
    Ok((cancelled, had_run))
}
