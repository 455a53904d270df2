//! `cancel`: an item's live jobs cancelled, its unfinished stages `cancelled`
//! (`items.rs`), and a parent's unfinished children and its gather with it
//! (`children.rs`).

use diesel_async::AsyncPgConnection;
use idemstage_domain::{BulkId, ItemId, JobId, RunId, StageName, TenantId};
use serde::Serialize;

use super::{audit, stored_hash, Actor, OpsError};

mod children;
mod items;

use children::{cancel_children, cancel_gathers};
pub(crate) use children::{GATHERS_SQL, LOCK_CHILD_RUNS_SQL, OPEN_CHILDREN_SQL};
use items::cancel_items;
pub(crate) use items::{CANCEL_QUEUED_SQL, CANCEL_RUNS_SQL, LOCK_RUNS_SQL};

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
    let (mut stages, jobs) = cancel_items(conn, tenant, std::slice::from_ref(item), actor, &reason)
        .await?
        .pop()
        .unwrap_or_default();
    let children = cancel_children(conn, tenant, item, actor, bulk).await?;
    stages.extend(cancel_gathers(conn, tenant, item, actor, &reason).await?);
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
