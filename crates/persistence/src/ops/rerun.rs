//! `rerun`: a finished stage runs again on its current input and upstream, and
//! everything computed from it is invalidated.

use chrono::{DateTime, Utc};
use diesel::sql_types::{Integer, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{BulkId, ItemId, RunId, RunStatus, SendResult, StageName, TenantId};
use serde::Serialize;

use super::{audit, stored_hash, Actor, OpsError, RetryPlanner};

/// Why a stage could not be rerun: a worker holds it, or its item was
/// cancelled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum RerunRefusal {
    /// A worker holds a live lease on it: its attempt finishes first.
    Running {
        /// When the lease runs out (database clock).
        lease_expires_at: DateTime<Utc>,
    },
    /// The item was cancelled (this stage or another): final.
    Cancelled,
}

impl std::fmt::Display for RerunRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RerunRefusal::Running { lease_expires_at } => {
                write!(f, "it is running (lease until {lease_expires_at})")
            }
            RerunRefusal::Cancelled => f.write_str("it was cancelled"),
        }
    }
}

/// What [`rerun`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum RerunOutcome {
    /// The stage was `success` or `dead`: it is `stale` now, its results are no
    /// longer current, and it has a live job; every stage computed from it is
    /// `stale` too (and runs once this stage has succeeded again).
    Rerun {
        /// The stage.
        stage: StageName,
        /// Its run.
        run_id: RunId,
        /// What it was: `success` or `dead`.
        from: RunStatus,
        /// Attempts it used so far (the rerun is attempt `attempts + 1`, with a
        /// fresh budget).
        attempts: i32,
        /// How many stages after it were invalidated.
        invalidated: u64,
        /// The job sent for it; `Duplicate`: a live job of its singleton key
        /// exists already and will claim it.
        job: SendResult,
    },
    /// The stage is `failed`, `stale`, or `running` with an expired lease: the
    /// workers run it again anyway, on its current input; or `waiting`: its
    /// signal or deadline runs it again. Nothing changed.
    NothingToRerun {
        /// The stage.
        stage: StageName,
        /// Its status.
        status: RunStatus,
    },
}

#[derive(QueryableByName)]
struct MarkedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    was: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
}

/// The conditional write: the run, if it is still `success` or `dead`, becomes
/// `stale` with no current success, which the claim admits with a fresh budget
/// (its guard compares a new attempt only with a current success). The row lock
/// of the sub-select orders it with a worker's fenced commit of the stage. Not
/// for an item that was cancelled (a stage of it `cancelled`): final. `$1`
/// tenant, `$2` item, `$3` stage, `$4` reason.
pub(crate) const MARK_RERUN: &str = "\
UPDATE stage_runs r
   SET status = 'stale', success_attempt = NULL, last_error = $4,
       lease_expires_at = least(r.lease_expires_at, clock_timestamp())
  FROM (SELECT id, status FROM stage_runs
         WHERE tenant_id = $1 AND item_id = $2 AND stage = $3
           FOR UPDATE) AS old
 WHERE r.id = old.id AND old.status IN ('success', 'dead')
   AND NOT EXISTS (SELECT 1 FROM stage_runs c
                    WHERE c.tenant_id = $1 AND c.item_id = $2 AND c.status = 'cancelled')
RETURNING r.id, old.status AS was, r.attempts";

/// The record that makes the next success on the same input a rerun asked for.
/// `$1` tenant, `$2` run, `$3` after attempt, `$4` actor, `$5` bulk action.
pub(crate) const RECORD_RERUN: &str = "\
INSERT INTO stage_reruns (tenant_id, run_id, after_attempt, actor, bulk_id)
VALUES ($1, $2, $3, $4, $5)";

/// Reruns `stage` of the item: a stage that is `success` (or `dead`) runs again
/// on the input and upstream its lineage names now, through the normal claim,
/// with a fresh attempt budget; every stage computed from it is invalidated
/// (`stale`, a running attempt of one fenced) and runs again after it, as after
/// an upstream's new success. One transaction scoped to `tenant`, with a
/// `stage_reruns` row (so the second success on the same input is a rerun asked
/// for, not a double execution) and its `audit_log` entry (`operator.rerun`, with
/// `actor`).
///
/// Until it has succeeded again the stage has no current result: nothing after
/// it runs, and a reader of its output finds none. Refused with nothing
/// changed: an unknown item (`ItemNotFound`), a stage the planner does not know
/// (`UnknownStage`), one without a run (`StageNotStarted`), one running with a
/// live lease or cancelled (`RerunRefused`). `NothingToRerun`: the stage is
/// going to run again anyway.
pub async fn rerun(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
    actor: &Actor,
    planner: &dyn RetryPlanner,
) -> Result<RerunOutcome, OpsError> {
    if planner.budget(stage).is_none() {
        return Err(OpsError::UnknownStage(stage.to_string()));
    }
    let mut tries = 0;
    loop {
        let result = crate::tenant::transaction::<_, OpsError, _>(conn, tenant, async |conn| {
            rerun_in(conn, tenant, item, stage, actor, None, planner).await
        })
        .await;
        if !super::again_after(&result, &mut tries).await {
            return result;
        }
    }
}

/// [`rerun`] in the caller's transaction (scoped to `tenant`); `bulk` names the
/// bulk action it is part of, in the audit entry and the `stage_reruns` row.
pub(super) async fn rerun_in(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
    actor: &Actor,
    bulk: Option<&BulkId>,
    planner: &dyn RetryPlanner,
) -> Result<RerunOutcome, OpsError> {
    let hash = stored_hash(conn, tenant, item).await?;
    let marked: Option<MarkedRow> = diesel::sql_query(MARK_RERUN)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(stage.as_str())
        .bind::<Text, _>(format!("rerun asked for by {actor}"))
        .get_result(conn)
        .await
        .map(Some)
        .or_else(|e| match e {
            diesel::result::Error::NotFound => Ok(None),
            e => Err(e),
        })?;
    let Some(marked) = marked else {
        return not_marked(conn, tenant, item, stage).await;
    };
    let bulk_text = bulk.map(|b| b.to_string());
    diesel::sql_query(RECORD_RERUN)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(&marked.id)
        .bind::<Integer, _>(marked.attempts)
        .bind::<Text, _>(actor.as_str())
        .bind::<Nullable<Text>, _>(bulk_text.as_deref())
        .execute(conn)
        .await?;
    let invalidated = diesel::sql_query(crate::runs::sql::INVALIDATE_DOWNSTREAM)
        .bind::<Text, _>(tenant.as_str())
        .bind::<Text, _>(item.to_string())
        .bind::<Text, _>(stage.as_str())
        .bind::<Text, _>(format!(
            "upstream stage {stage} is rerun (asked for by {actor})"
        ))
        .execute(conn)
        .await? as u64;
    let job = planner.job(stage, tenant, item, &hash);
    let sent = crate::queue::send_in(conn, &job).await?;
    let from: RunStatus = marked.was.parse()?;
    let run_id = RunId::parse(&marked.id)?;
    let details = serde_json::json!({
        "actor": actor,
        "stage": stage,
        "run_id": run_id,
        "from": from,
        "attempts": marked.attempts,
        "invalidated": invalidated,
        "job": match &sent {
            SendResult::Sent(id) => serde_json::json!(id),
            SendResult::Duplicate => serde_json::json!("duplicate"),
        },
    });
    audit(conn, tenant, item, "operator.rerun", details, bulk).await?;
    Ok(RerunOutcome::Rerun {
        stage: stage.clone(),
        run_id,
        from,
        attempts: marked.attempts,
        invalidated,
        job: sent,
    })
}

/// The stage was not `success` or `dead` when the write ran: say what it is.
async fn not_marked(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
) -> Result<RerunOutcome, OpsError> {
    let state = super::run_state(conn, tenant, item, stage).await?;
    let status: RunStatus = state.status.parse()?;
    let refused = |reason| OpsError::RerunRefused {
        tenant: tenant.clone(),
        item: *item,
        stage: stage.clone(),
        reason,
    };
    match status {
        // Success or dead, not marked: a stage of the item was cancelled.
        RunStatus::Cancelled | RunStatus::Success | RunStatus::Dead => {
            Err(refused(RerunRefusal::Cancelled))
        }
        RunStatus::Running if state.lease_live => Err(refused(RerunRefusal::Running {
            lease_expires_at: state.lease_expires_at,
        })),
        status => Ok(RerunOutcome::NothingToRerun {
            stage: stage.clone(),
            status,
        }),
    }
}
