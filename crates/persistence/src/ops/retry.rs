//! `retry`: a dead stage gets a fresh attempt budget and a new job.

use diesel::sql_types::{Array, Integer, Nullable, Text};
use diesel::QueryableByName;
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use idemstage_domain::{
    BulkId, ItemId, JobToSend, RunId, RunStatus, SendResult, StageName, TenantId,
};
use serde::Serialize;

use super::{audit, stored_hash, Actor, OpsError, RetryRefusal};

/// What a retry needs to know of the pipeline: a stage's fresh attempt budget
/// and the job that starts it (with the pipeline's singleton key and send
/// options). `idemstage::pipeline::Pipeline` implements it.
pub trait RetryPlanner: Send + Sync {
    /// The fresh attempt budget of `stage` (its policy's `max_attempts`), `None`
    /// if it is not a stage of the pipeline.
    fn budget(&self, stage: &StageName) -> Option<i32>;

    /// The job that starts `stage` for the item; `input_hash` is the
    /// item's stored input hash.
    fn job(
        &self,
        stage: &StageName,
        tenant: &TenantId,
        item: &ItemId,
        input_hash: &str,
    ) -> JobToSend;
}

/// One stage a retry revived.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RetriedStage {
    /// The stage.
    pub stage: StageName,
    /// Its run.
    pub run_id: RunId,
    /// Attempts it used so far (unchanged: the next claim is attempt
    /// `attempts + 1`).
    pub attempts: i32,
    /// Its new budget: `attempts` plus the stage's `max_attempts`.
    pub max_attempts: i32,
    /// The error it died of.
    pub last_error: Option<String>,
    /// The job sent for it; `Duplicate`: a live job of its singleton key exists
    /// already and will claim it.
    pub job: SendResult,
}

/// What [`retry`] did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum RetryOutcome {
    /// These stages were `dead`: each is `failed` now, claimable within its
    /// fresh budget, and has a live job.
    Retried {
        /// The stages, in the order they were first claimed.
        stages: Vec<RetriedStage>,
    },
    /// Nothing was dead, so nothing changed. For one stage: it is `failed`,
    /// `stale`, or `running` with an expired lease, and the workers retry it
    /// themselves (or a concurrent retry came first), or `waiting`, and its
    /// signal or deadline runs it again. For the whole item: no
    /// stage of it is dead.
    NothingToRetry {
        /// The stage asked for, if one was.
        stage: Option<StageName>,
        /// Its status, if one was asked for.
        status: Option<RunStatus>,
    },
}

#[derive(QueryableByName)]
struct DeadRow {
    #[diesel(sql_type = Text)]
    stage: String,
}

#[derive(QueryableByName)]
struct RevivedRow {
    #[diesel(sql_type = Text)]
    id: String,
    #[diesel(sql_type = Text)]
    stage: String,
    #[diesel(sql_type = Integer)]
    attempts: i32,
    #[diesel(sql_type = Integer)]
    max_attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
}

/// The conditional write: every named stage that is still `dead` becomes
/// `failed` with `$4[i]` more attempts. `$1` tenant, `$2` item, `$3` stages,
/// `$4` budgets. A concurrent retry waits for this row lock and then finds
/// `failed`: it revives nothing.
const REVIVE_SQL: &str = "\
UPDATE stage_runs r
   SET status = 'failed', max_attempts = r.attempts + p.budget
  FROM unnest($3::text[], $4::int[]) AS p(stage, budget)
 WHERE r.tenant_id = $1 AND r.item_id = $2 AND r.stage = p.stage AND r.status = 'dead'
RETURNING r.id, r.stage, r.attempts, r.max_attempts, r.last_error";

const DEAD_STAGES_SQL: &str = "\
SELECT stage FROM stage_runs
 WHERE tenant_id = $1 AND item_id = $2 AND status = 'dead'
 ORDER BY created_at, id";

/// Retries `stage` of the item, or with `None` every dead stage of it: each
/// `dead` stage gets a fresh attempt budget (`attempts` + the stage's
/// `max_attempts`, so the attempt numbers, the fencing tokens, go on growing)
/// and a new job (`planner.job`, with the pipeline's singleton key), in one
/// transaction scoped to `tenant` with its `audit_log` entry (`operator.retry`,
/// with `actor`). The stage then runs through the normal claim, so it reads its
/// upstream's current success like any other attempt (lineage).
///
/// Refused with nothing changed: an unknown item (`ItemNotFound`), a
/// stage the planner does not know (`UnknownStage`), a stage without a run
/// (`StageNotStarted`), one that succeeded, is running with a live lease or was
/// cancelled (`RetryRefused`). A stage that is not dead but will be retried by
/// the workers anyway (failed, stale, an expired lease), or an item without a
/// dead stage, is `NothingToRetry`: two concurrent retries revive a stage once,
/// and the second finds it `failed`.
pub async fn retry(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: Option<&StageName>,
    actor: &Actor,
    planner: &dyn RetryPlanner,
) -> Result<RetryOutcome, OpsError> {
    if let Some(s) = stage {
        if planner.budget(s).is_none() {
            return Err(OpsError::UnknownStage(s.to_string()));
        }
    }
    let mut tries = 0;
    loop {
        let result = crate::tenant::transaction::<_, OpsError, _>(conn, tenant, async |conn| {
            retry_in(conn, tenant, item, stage, actor, None, planner).await
        })
        .await;
        if !super::again_after(&result, &mut tries).await {
            return result;
        }
    }
}

/// [`retry`] in the caller's transaction (scoped to `tenant`); `bulk` names the
/// bulk action it is part of, in the audit entry.
pub(super) async fn retry_in(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: Option<&StageName>,
    actor: &Actor,
    bulk: Option<&BulkId>,
    planner: &dyn RetryPlanner,
) -> Result<RetryOutcome, OpsError> {
    let hash = stored_hash(conn, tenant, item).await?;
    // The stages to revive and their budgets. Without a stage: those dead now (a
    // read only for the budgets; the write below re-checks `dead` itself).
    let names: Vec<StageName> = match stage {
        Some(s) => vec![s.clone()],
        None => {
            let dead: Vec<DeadRow> = diesel::sql_query(DEAD_STAGES_SQL)
                .bind::<Text, _>(tenant.as_str())
                .bind::<Text, _>(item.to_string())
                .load(conn)
                .await?;
            dead.iter()
                .map(|d| StageName::parse(&d.stage))
                .collect::<Result<_, _>>()?
        }
    };
    let mut budgets = Vec::with_capacity(names.len());
    for name in &names {
        budgets.push(
            planner
                .budget(name)
                .ok_or_else(|| OpsError::UnknownStage(name.to_string()))?,
        );
    }
    let mut revived: Vec<RevivedRow> = if names.is_empty() {
        Vec::new()
    } else {
        diesel::sql_query(REVIVE_SQL)
            .bind::<Text, _>(tenant.as_str())
            .bind::<Text, _>(item.to_string())
            .bind::<Array<Text>, _>(names.iter().map(|s| s.as_str()).collect::<Vec<_>>())
            .bind::<Array<Integer>, _>(&budgets)
            .load(conn)
            .await?
    };
    // In pipeline order (the order the runs were created), whatever RETURNING's.
    revived.sort_by_key(|r| names.iter().position(|n| n.as_str() == r.stage));
    if revived.is_empty() {
        return match stage {
            None => Ok(RetryOutcome::NothingToRetry {
                stage: None,
                status: None,
            }),
            Some(s) => not_revived(conn, tenant, item, s).await,
        };
    }
    let mut stages = Vec::with_capacity(revived.len());
    for r in revived {
        let name = StageName::parse(&r.stage)?;
        let job = planner.job(&name, tenant, item, &hash);
        let sent = crate::queue::send_in(conn, &job).await?;
        stages.push(RetriedStage {
            stage: name,
            run_id: RunId::parse(&r.id)?,
            attempts: r.attempts,
            max_attempts: r.max_attempts,
            last_error: r.last_error,
            job: sent,
        });
    }
    let details = serde_json::json!({
        "actor": actor,
        "stages": stages.iter().map(|s| serde_json::json!({
            "stage": s.stage,
            "run_id": s.run_id,
            "attempts": s.attempts,
            "max_attempts": s.max_attempts,
            "last_error": s.last_error,
            "job": match &s.job {
                SendResult::Sent(id) => serde_json::json!(id),
                SendResult::Duplicate => serde_json::json!("duplicate"),
            },
        })).collect::<Vec<_>>(),
    });
    audit(conn, tenant, item, "operator.retry", details, bulk).await?;
    Ok(RetryOutcome::Retried { stages })
}

/// The one stage asked for was not dead when the write ran: say what it is.
async fn not_revived(
    conn: &mut AsyncPgConnection,
    tenant: &TenantId,
    item: &ItemId,
    stage: &StageName,
) -> Result<RetryOutcome, OpsError> {
    let state = super::run_state(conn, tenant, item, stage).await?;
    let status: RunStatus = state.status.parse()?;
    let refused = |reason| OpsError::RetryRefused {
        tenant: tenant.clone(),
        item: *item,
        stage: stage.clone(),
        reason,
    };
    match status {
        RunStatus::Success => Err(refused(RetryRefusal::Succeeded)),
        RunStatus::Cancelled => Err(refused(RetryRefusal::Cancelled)),
        RunStatus::Running if state.lease_live => Err(refused(RetryRefusal::Running {
            lease_expires_at: state.lease_expires_at,
        })),
        // Dead cannot be (the write would have revived it): failed, stale, an
        // expired lease. The workers take these over by themselves.
        other => Ok(RetryOutcome::NothingToRetry {
            stage: Some(stage.clone()),
            status: Some(other),
        }),
    }
}
