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
    /// A gather with neither a run nor a job yet (its fan-out's children were
    /// not all final): its run is created `cancelled`, so it never runs, even
    /// when its children's counts complete the fan-out.
    AwaitingChildren,
}

impl std::fmt::Display for CancelledFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CancelledFrom::Running {
                attempt,
                lease_live: true,
            } => write!(f, "running (attempt {attempt} fenced)"),
            CancelledFrom::Running { attempt, .. } => {
                write!(f, "running, lease expired (attempt {attempt} fenced)")
            }
            CancelledFrom::Failed => f.write_str("failed"),
            CancelledFrom::Stale => f.write_str("stale"),
            CancelledFrom::Waiting => f.write_str("waiting"),
            CancelledFrom::Queued => f.write_str("queued"),
            CancelledFrom::RerunQueued => f.write_str("succeeded, its rerun queued"),
            CancelledFrom::AwaitingChildren => f.write_str("waiting for its children"),
        }
    }
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

/// A child item of the cancelled item's current fan-out that was not final,
/// cancelled with it (an `operator.cancel` audit entry of its own).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CancelledChild {
    /// The child item.
    pub item: ItemId,
    /// Its stages that ended `cancelled`.
    pub stages: Vec<CancelledStage>,
    /// Its jobs that ended `cancelled`.
    pub jobs: Vec<CancelledJob>,
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
        /// The children of its current fan-outs that were not final, cancelled
        /// with it (empty for an item that fanned out nothing).
        children: Vec<CancelledChild>,
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

/// Cancels the item: every live job whose payload names it ends `cancelled`
/// (a worker holding one is fenced on its job lease), and every stage of it that
/// is not final (`running`, `failed`, `stale`, or with only a queued job) ends
/// `cancelled`, a final status no claim takes: a running attempt's commit is
/// refused by the fence (`Fenced`), and nothing of it is written. A success whose
/// rerun on another input is queued ends `cancelled` too (its results stay
/// current). Other final stages (`success`, `dead`) stay as they are, and so do
/// their results. A parent's cancel cancels the unfinished children of its
/// current fan-outs too, and its gather if it has not run.
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

/// The unfinished children of the item's current fan-outs (not superseded by
/// a rerun of the fan-out stage). `$1` tenant, `$2` the parent item.
pub(crate) const OPEN_CHILDREN_SQL: &str = "\
SELECT c.item_id AS id FROM fanouts f
  JOIN fanout_children c
    ON c.tenant_id = f.tenant_id AND c.parent_item = f.parent_item
   AND c.stage = f.stage AND c.attempt = f.attempt
 WHERE f.tenant_id = $1 AND f.parent_item = $2 AND f.superseded_at IS NULL
   AND c.outcome IS NULL
 ORDER BY c.item_id";

/// Every run of those children, locked before any of them is cancelled: a
/// child's final commit holds its run's lock while it counts itself on the
/// fan-out's row, which cancelling a child (its trigger) takes too, so taking
/// the runs one child at a time could wait on a child holding the other.
/// `$1` tenant, `$2` the children.
pub(crate) const LOCK_CHILD_RUNS_SQL: &str = "\
SELECT id FROM stage_runs
 WHERE tenant_id = $1 AND item_id = ANY($2::text[])
 ORDER BY item_id, created_at, id
   FOR UPDATE";

/// The gather stages of the item's current fan-outs. `$1` tenant, `$2` item.
pub(crate) const GATHERS_SQL: &str = "\
SELECT DISTINCT gather_stage AS id FROM fanouts
 WHERE tenant_id = $1 AND parent_item = $2 AND superseded_at IS NULL";

/// [`cancel`] in the caller's transaction (scoped to `tenant`); `bulk` names the
/// bulk action it is part of, in the audit entry. A parent's cancel goes on to
/// its current fan-outs: their unfinished children are cancelled (each audited
/// on its own item, naming the parent), and a gather that has no run yet gets
/// one `cancelled` (the children's counts complete the fan-out, and nothing
/// runs the gather then).
pub(super) async fn cancel_in(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    actor: &Actor,
    bulk: Option<&BulkId>,
) -> Result<CancelOutcome, OpsError> {
    stored_hash(conn, tenant, item).await?;
    let reason = format!("cancelled by {actor}");
    let (mut stages, jobs) = cancel_item(conn, tenant, item, actor, &reason).await?;
    let children = cancel_children(conn, tenant, item, actor, bulk).await?;
    let worker = format!("operator:{actor}");
    let gathers: Vec<InsertedRun> = diesel::sql_query(GATHERS_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .load(conn)
        .await?;
    for gather in gathers {
        let stage = StageName::parse(&gather.id)?;
        if let Some(run_id) =
            insert_cancelled_run(conn, tenant, item, &stage, &worker, &reason).await?
        {
            stages.push(CancelledStage {
                stage,
                run_id,
                from: CancelledFrom::AwaitingChildren,
            });
        }
    }
    if stages.is_empty() && jobs.is_empty() && children.is_empty() {
        return Ok(CancelOutcome::NothingToCancel);
    }
    let child_items: Vec<&ItemId> = children.iter().map(|c| &c.item).collect();
    let mut details = serde_json::json!({ "actor": actor, "stages": stages, "jobs": jobs });
    if !child_items.is_empty() {
        details["children"] = serde_json::json!(child_items);
    }
    audit(conn, tenant, item, "operator.cancel", details, bulk).await?;
    Ok(CancelOutcome::Cancelled {
        stages,
        jobs,
        children,
    })
}

/// Cancels the unfinished children of `parent`'s current fan-outs, their runs
/// locked first (all of them, in one statement).
async fn cancel_children(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    parent: &ItemId,
    actor: &Actor,
    bulk: Option<&BulkId>,
) -> Result<Vec<CancelledChild>, OpsError> {
    let open: Vec<InsertedRun> = diesel::sql_query(OPEN_CHILDREN_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(parent.to_string())
        .load(conn)
        .await?;
    if open.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<String> = open.into_iter().map(|r| r.id).collect();
    let _locked: Vec<InsertedRun> = diesel::sql_query(LOCK_CHILD_RUNS_SQL)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Array<Text>, _>(&ids)
        .load(conn)
        .await?;
    let reason = format!("cancelled by {actor} with its parent {parent}");
    let mut children = Vec::with_capacity(ids.len());
    for id in &ids {
        let child = ItemId::parse(id)?;
        let (stages, jobs) = cancel_item(conn, tenant, &child, actor, &reason).await?;
        if stages.is_empty() && jobs.is_empty() {
            continue; // it became final before the lock
        }
        let details = serde_json::json!({
            "actor": actor, "parent": parent, "stages": stages, "jobs": jobs,
        });
        audit(conn, tenant, &child, "operator.cancel", details, bulk).await?;
        children.push(CancelledChild {
            item: child,
            stages,
            jobs,
        });
    }
    Ok(children)
}

/// The item's own cancel: its unfinished runs, its live jobs, and a run created
/// `cancelled` for each stage that had only a job.
async fn cancel_item(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    actor: &Actor,
    reason: &str,
) -> Result<(Vec<CancelledStage>, Vec<CancelledJob>), OpsError> {
    let (mut stages, had_run) = cancel_runs(conn, tenant, item, None, reason).await?;
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
        .bind::<Text, _>(reason)
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
    Ok((stages, jobs))
}

/// A run created `cancelled` for a stage that has none ([`CANCEL_QUEUED_SQL`]);
/// `None` if it has one (created since the lock, or there before).
async fn insert_cancelled_run(
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
