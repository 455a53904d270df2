//! The repository traits the stage layer depends on. `persistence` implements them
//! on PostgreSQL; nothing here knows about SQL.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use serde::Serialize;

use crate::queue::{JobCompleteOutcome, JobToSend, SendResult};
use crate::{
    AnfrageId, ClaimOutcome, CompleteOutcome, FailOutcome, JobId, RenewOutcome, RepoError, RowId,
    RunId, RunStatus, StageError, StageName, StagePolicy, TenantId, WorkerId,
};

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

/// The writes a stage body may make, all inside one transaction that has already
/// checked the fencing token and marked the run `success`. If anything here fails,
/// or the body returns an error, the whole transaction rolls back.
#[async_trait]
pub trait FencedTx: Send {
    fn token(&self) -> &ClaimToken;

    /// DELETE-before-INSERT of the anfrage's `anfrage_extraktionen`.
    async fn replace_extraktionen(&mut self, rows: &[Extraktion]) -> Result<usize, RepoError>;

    /// Per-row upsert variant for large child sets: upsert each position, then delete
    /// positions beyond the new set. Same end state as `replace_extraktionen`.
    async fn upsert_extraktionen(&mut self, rows: &[Extraktion]) -> Result<usize, RepoError>;

    /// Insert-or-get of a `dateien` row by `(tenant_id, sha256, s3_key)`, followed by an
    /// audit entry that names the id that exists.
    async fn insert_or_get_datei(
        &mut self,
        sha256: &str,
        s3_key: &str,
        size_bytes: i64,
    ) -> Result<DateiRef, RepoError>;

    async fn audit(
        &mut self,
        entity_id: &str,
        action: &str,
        details: serde_json::Value,
    ) -> Result<RowId, RepoError>;

    async fn put_feasibility(
        &mut self,
        feasible: bool,
        reasons: serde_json::Value,
    ) -> Result<(), RepoError>;

    async fn put_calculation(
        &mut self,
        total_cents: i64,
        lines: serde_json::Value,
    ) -> Result<(), RepoError>;

    /// Sends a job in this transaction: it exists (and wakes workers) only if the
    /// completion commits.
    async fn send_job(&mut self, job: &JobToSend) -> Result<SendResult, RepoError>;

    /// Completes the queue job this execution runs for, in this transaction, fenced
    /// on the job's token: the job is completed if and only if the stage's success
    /// commits. `Fenced` (the job was taken over) does not stop the commit.
    async fn complete_job(
        &mut self,
        job: JobId,
        attempt: i32,
    ) -> Result<JobCompleteOutcome, RepoError>;

    /// Reads the anfrage's input text (same transaction, same tenant).
    async fn anfrage_text(&mut self) -> Result<String, RepoError>;

    /// Reads the anfrage's extracted positions.
    async fn extraktionen(&mut self) -> Result<Vec<Extraktion>, RepoError>;
}

/// The stage's writes, run inside the fenced transaction. It is `Fn`, not `FnOnce`,
/// because a serialization failure or deadlock re-runs the whole transaction.
pub type FencedWrite<'a> = dyn for<'t> Fn(&'t mut dyn FencedTx) -> BoxFuture<'t, Result<(), StageError>>
    + Send
    + Sync
    + 'a;

#[async_trait]
pub trait RunRepository: Send + Sync {
    /// The one atomic claim statement (plus a read when it returns no row, to say why).
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, RepoError>;

    /// Extends the lease from the database clock, if the token still holds.
    async fn renew_lease(
        &self,
        token: &ClaimToken,
        lease: Duration,
    ) -> Result<RenewOutcome, RepoError>;

    /// Checks the token and marks the run `success`, runs `write`, commits: all one
    /// transaction. Retries 40001/40P01; re-reads the run after an ambiguous commit.
    async fn complete(
        &self,
        token: &ClaimToken,
        write: &FencedWrite<'_>,
    ) -> Result<CompleteOutcome, StageError>;

    /// Records a failed attempt (fenced on the token). A permanent failure, or the
    /// last attempt of the budget, makes the run `dead`.
    async fn fail(
        &self,
        token: &ClaimToken,
        error: &str,
        retryable: bool,
    ) -> Result<FailOutcome, RepoError>;

    /// Gives the lease back without counting the attempt (a shutdown, a database
    /// error that interrupted the attempt); `reason` is recorded as `last_error`.
    async fn release(&self, token: &ClaimToken, reason: &str) -> Result<RenewOutcome, RepoError>;

    /// Marks the token's attempt `fenced` in the history (it lost its lease).
    async fn record_fenced(&self, token: &ClaimToken) -> Result<(), RepoError>;

    async fn read_run(
        &self,
        tenant: &TenantId,
        anfrage: &AnfrageId,
        stage: &StageName,
    ) -> Result<Option<RunRecord>, RepoError>;

    async fn attempt_history(&self, run_id: &RunId) -> Result<Vec<AttemptRecord>, RepoError>;
}
