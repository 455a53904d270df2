//! The records of layer 1 as the domain sees them: what a claim needs, the proof of
//! a claim, a run and its attempts. `persistence` reads and writes them on
//! PostgreSQL; nothing here knows about SQL.

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{AnfrageId, RowId, RunId, RunStatus, StageName, StagePolicy, TenantId, WorkerId};

/// Everything a claim needs.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    pub tenant: TenantId,
    pub anfrage: AnfrageId,
    pub stage: StageName,
    /// The job's input hash. For the first stage it must equal the anfrage's
    /// stored input hash (else `Rejected(InputMismatch)`); later stages bind their
    /// upstream's hash and ignore it.
    pub input_hash: String,
    pub worker: WorkerId,
    pub policy: StagePolicy,
    /// The stage before this one (`None` for the first stage): this stage runs only
    /// on its current successful attempt.
    pub upstream: Option<StageName>,
}

/// Proof of a claim: the run and the fencing token (`attempt`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClaimToken {
    pub run_id: RunId,
    pub tenant: TenantId,
    pub anfrage: AnfrageId,
    pub stage: StageName,
    pub attempt: i32,
}

/// A `pipeline_runs` row as the domain sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RunRecord {
    pub run_id: RunId,
    pub tenant: TenantId,
    pub anfrage: AnfrageId,
    pub stage: StageName,
    pub status: RunStatus,
    pub attempts: i32,
    pub max_attempts: i32,
    pub input_hash: String,
    pub worker_id: String,
    pub started_at: DateTime<Utc>,
    pub lease_expires_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
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
    pub attempt: i32,
    pub worker_id: String,
    pub input_hash: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// `running`, `success`, `failed`, `abandoned` or `fenced`.
    pub outcome: String,
    pub error: Option<String>,
    /// The upstream's successful attempt this attempt read.
    pub upstream_attempt: Option<i32>,
}

/// One extracted position (a child row of an anfrage).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct Extraktion {
    pub position_index: i32,
    pub description: String,
    pub quantity: Option<f64>,
    pub unit: Option<String>,
}

/// The id of a `dateien` row and whether this call created it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DateiRef {
    pub id: RowId,
    pub inserted: bool,
}
