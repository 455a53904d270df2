//! The records of layer 1 as the domain sees them: what a claim needs, the proof of
//! a claim, a run and its attempts. `persistence` reads and writes them on
//! PostgreSQL; nothing here knows about SQL.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{ItemId, RunId, RunStatus, StageName, StagePolicy, TenantId, WorkerId};

/// Everything a claim needs.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    /// The tenant; the claim runs scoped to it.
    pub tenant: TenantId,
    /// The item.
    pub item: ItemId,
    /// The stage to claim.
    pub stage: StageName,
    /// The job's input hash. For the first stage it must equal the item's
    /// stored input hash (else `Rejected(InputMismatch)`); later stages bind their
    /// upstream's hash and ignore it.
    pub input_hash: String,
    /// Who claims; recorded on the run and the attempt.
    pub worker: WorkerId,
    /// The stage's effective policy (budget, lease, input-change rule).
    pub policy: StagePolicy,
    /// The stage before this one (`None` for the first stage): this stage runs only
    /// on its current successful attempt.
    pub upstream: Option<StageName>,
}

/// Proof of a claim: the run and the fencing token (`attempt`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClaimToken {
    /// The run claimed.
    pub run_id: RunId,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its item.
    pub item: ItemId,
    /// Its stage.
    pub stage: StageName,
    /// The fencing token: the run's `attempts` at the claim. A write under an
    /// older attempt is refused.
    pub attempt: i32,
}

/// A `stage_runs` row as the domain sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RunRecord {
    /// The run's id.
    pub run_id: RunId,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its item.
    pub item: ItemId,
    /// Its stage.
    pub stage: StageName,
    /// Its status.
    pub status: RunStatus,
    /// Attempts claimed so far (the latest attempt's number).
    pub attempts: i32,
    /// The attempt budget, compared with `attempts`: a released attempt raises it
    /// by one (not counted), a claim after a success or `stale` by the policy's.
    pub max_attempts: i32,
    /// SHA-256 (hex) of the input the latest attempt is bound to.
    pub input_hash: String,
    /// The worker of the latest attempt.
    pub worker_id: String,
    /// When the latest attempt was claimed (database clock).
    pub started_at: DateTime<Utc>,
    /// When the latest attempt's lease ends or ended (database clock).
    pub lease_expires_at: DateTime<Utc>,
    /// When the latest attempt ended, if it did (database clock).
    pub finished_at: Option<DateTime<Utc>>,
    /// The error of the last failed attempt (sanitised).
    pub last_error: Option<String>,
    /// The attempt whose results are current, if any succeeded.
    pub success_attempt: Option<i32>,
    /// The stage the current attempt read from (`None` for a first stage).
    pub upstream_stage: Option<StageName>,
    /// That stage's successful attempt the current attempt read.
    pub upstream_attempt: Option<i32>,
}

/// One row of the attempt history.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AttemptRecord {
    /// The attempt's number.
    pub attempt: i32,
    /// The worker that claimed it.
    pub worker_id: String,
    /// SHA-256 (hex) of the input it was bound to.
    pub input_hash: String,
    /// When it was claimed (database clock).
    pub started_at: DateTime<Utc>,
    /// When it ended, if it did (database clock).
    pub finished_at: Option<DateTime<Utc>>,
    /// `running`, `success`, `failed`, `abandoned` or `fenced`.
    pub outcome: String,
    /// Its error, if it failed (sanitised).
    pub error: Option<String>,
    /// The upstream's successful attempt this attempt read.
    pub upstream_attempt: Option<i32>,
}
