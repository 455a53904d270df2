//! One item's (or several items') own cancel: their unfinished runs locked and
//! cancelled, their live jobs cancelled in one statement, a run created
//! `cancelled` for a stage that had only a job.

use diesel::sql_types::{Array, Bool, Integer, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::queue::stage_singleton_key;
use idemstage_domain::{ItemId, JobId, RunId, RunStatus, StageName, TenantId};

use super::{CancelledFrom, CancelledJob, CancelledStage};
use crate::ops::{Actor, OpsError};

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
    #[diesel(sql_type = diesel::sql_types::Nullable<Text>)]
    item_id: Option<String>,
}

#[derive(QueryableByName)]
pub(super) struct InsertedRun {
    #[diesel(sql_type = Text)]
    pub(super) id: String,
}

/// Every run of the item, locked in the order the runs were created: a
/// downstream run is created after its upstream succeeded, so this is
/// upstream-first, the order of the fenced completion's locks (share on the
/// upstream, then its own row).
pub(crate) const LOCK_RUNS_SQL: &str = "\
SELECT id, stage, status, attempts,
       (status = 'running' AND lease_expires_at >= clock_timestamp()) AS lease_live
  FROM stage_runs
 WHERE tenant_id = $1 AND item_id = $2 AND ($3::text IS NULL OR stage = $3)
 ORDER BY created_at, id
   FOR UPDATE";

/// The unfinished runs among the locked ones end `cancelled`. `$1` tenant, `$2`
/// item, `$3` run ids, `$4` the reason.
pub(crate) const CANCEL_RUNS_SQL: &str = "\
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
pub(crate) const CANCEL_QUEUED_SQL: &str = "\
INSERT INTO stage_runs
    (id, tenant_id, item_id, stage, status, attempts, max_attempts, input_hash,
     worker_id, started_at, lease_expires_at, finished_at, last_error)
SELECT $1, a.tenant_id, a.id, $4, 'cancelled', 1, 1, a.input_sha256, $5,
       clock_timestamp(), clock_timestamp(), clock_timestamp(), $6
  FROM items a WHERE a.tenant_id = $2 AND a.id = $3
ON CONFLICT (tenant_id, item_id, stage) DO NOTHING
RETURNING id";

/// The live jobs whose payload names one of the items (`$2`) of the tenant
/// (`$1`), cancelled in one statement (one pass over `jobs`, however many
/// items: a parent's cancel names all its children), locked in id order.
/// `$3` the reason.
/// A job with a current claim is `active` (its claim's attempt is recorded).
/// Every job ends by a closure (`queue/finish.rs`): this cancel's, or one
/// already there (it was completed), which leaves it alone; a cancelled job's
/// singleton key is released by `jobs`' trigger.
const CANCEL_JOBS_SQL: &str = "\
WITH live AS (
    SELECT j.id, j.ready_seq, j.queue, j.tenant_id, j.priority, j.singleton_key,
           coalesce(k.attempt, j.attempt) AS attempt, k.claimed_at,
           CASE WHEN k.ready_seq IS NULL THEN j.state ELSE 'active' END AS state
      FROM jobs j
      LEFT JOIN job_claims k ON k.ready_seq = j.ready_seq AND k.job_id = j.id
     WHERE j.state IN ('created', 'retry')
       AND j.payload->>'tenant_id' = $1 AND j.payload->>'item_id' = ANY($2::text[])
     ORDER BY j.id FOR UPDATE OF j
), closed AS (
    INSERT INTO job_closures (ready_seq, job_id, attempt, queue, tenant_id, priority, outcome)
    SELECT live.ready_seq, live.id, live.attempt, live.queue, live.tenant_id, live.priority,
           'cancelled'
      FROM live
     ORDER BY live.id
    ON CONFLICT (ready_seq) DO NOTHING
    RETURNING ready_seq
)
UPDATE jobs j SET state = 'cancelled', completed_at = now(), attempt = live.attempt,
       started_at = coalesce(live.claimed_at, j.started_at), last_error = $3
  FROM live WHERE j.id = live.id AND live.ready_seq IN (SELECT ready_seq FROM closed)
RETURNING j.id, j.queue, live.state, j.singleton_key,
          j.payload->>'input_hash' AS input_hash, j.payload->>'item_id' AS item_id";

/// The items' own cancel: each item's unfinished runs (locked here, or by the
/// caller before), their live jobs in one statement, and a run created
/// `cancelled` for each stage that had only a job. One entry per item, in the
/// order given.
pub(super) async fn cancel_items(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    items: &[ItemId],
    actor: &Actor,
    reason: &str,
) -> Result<Vec<(Vec<CancelledStage>, Vec<CancelledJob>)>, OpsError> {
    let mut cancelled = Vec::with_capacity(items.len());
    let mut had_run = Vec::with_capacity(items.len());
    for item in items {
        let (stages, with_run) = cancel_runs(conn, tenant, item, None, reason).await?;
        cancelled.push((stages, Vec::new()));
        had_run.push(with_run);
    }
    // A statement of its own, so a snapshot after the locks above: a job sent by
    // a commit they waited for is seen.
    let ids: Vec<String> = items.iter().map(ToString::to_string).collect();
    let cancelled_jobs: Vec<CancelledJobRow> = diesel::sql_query(CANCEL_JOBS_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Array<Text>, _>(&ids)
        .bind::<Text, _>(reason)
        .load(conn)
        .await?;
    // Stages whose job was live but that had no run: they get one, `cancelled`.
    let worker = format!("operator:{actor}");
    for j in cancelled_jobs {
        let Some(at) = ids.iter().position(|id| Some(id) == j.item_id.as_ref()) else {
            continue; // the statement names only these items
        };
        let item = &items[at];
        let (stages, jobs) = &mut cancelled[at];
        jobs.push(CancelledJob {
            id: JobId::parse(&j.id)?,
            queue: j.queue.clone(),
            state: j.state.clone(),
        });
        let Ok(stage) = StageName::parse(&j.queue) else {
            continue; // not a stage's queue
        };
        if j.singleton_key.as_deref() != Some(&stage_singleton_key(&stage, tenant, item)) {
            continue; // not the stage's own job
        }
        if had_run[at].contains(&stage) {
            // A first stage's success whose rerun on another input was queued: the
            // rerun is what the cancel stops, so the stage ends cancelled (results
            // kept).
            let rerun: Vec<InsertedRun> = diesel::sql_query(CANCEL_QUEUED_RERUN_SQL)
                .bind::<Text, _>(tenant.as_str())
                .bind::<Text, _>(item.to_string())
                .bind::<Text, _>(stage.as_str())
                .bind::<diesel::sql_types::Nullable<Text>, _>(j.input_hash.as_deref())
                .bind::<Text, _>(reason)
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
        match insert_cancelled_run(conn, tenant, item, &stage, &worker, reason).await? {
            Some(run_id) => stages.push(CancelledStage {
                stage,
                run_id,
                from: CancelledFrom::Queued,
            }),
            None => {
                // A worker that had fetched the job claimed it after the lock.
                let (more, _) = cancel_runs(conn, tenant, item, Some(&stage), reason).await?;
                stages.extend(more);
            }
        }
    }
    Ok(cancelled)
}

/// A run created `cancelled` for a stage that has none ([`CANCEL_QUEUED_SQL`]);
/// `None` if it has one (created since the lock, or there before).
pub(super) async fn insert_cancelled_run(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
    worker: &str,
    reason: &str,
) -> Result<Option<RunId>, OpsError> {
    let inserted: Vec<InsertedRun> = diesel::sql_query(CANCEL_QUEUED_SQL)
        .bind::<Text, _>(RunId::new().to_string())
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(stage.as_str())
        .bind::<Text, _>(worker)
        .bind::<Text, _>(reason)
        .load(conn)
        .await?;
    inserted
        .into_iter()
        .next()
        .map(|row| RunId::parse(&row.id))
        .transpose()
        .map_err(Into::into)
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
