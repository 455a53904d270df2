//! The stage layer: the `Stage` trait, pipelines of stages, and the executor that
//! runs one stage execution: claim → skip or run → fenced commit (with the next
//! stage's job) or fail, renewing the lease while the body runs.
//!
//! Invariant: this crate names no table and no SQL. A stage body writes through the
//! fenced transaction handle (`FencedTx`) that `persistence` opens.

pub mod example;
mod executor;
mod pipeline;
mod start;

pub use executor::{ExecutionOutcome, Executor, JobLease};
pub use pipeline::{first_job, Pipeline, PipelineError, StageJob};
pub use start::{start, start_in};

use async_trait::async_trait;
use idemstage_domain::{StageError, StageName, StagePolicy};
use idemstage_persistence::FencedTx;

/// What the pipeline does after a stage succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum StageFlow {
    /// Send the next stage's job (in the same transaction), if there is one.
    Continue,
    /// The anfrage ends here (e.g. infeasible): no further stage.
    Stop,
}

/// One stage of a pipeline. A product team implements this in its own crate.
#[async_trait]
pub trait Stage: Send + Sync + 'static {
    fn name(&self) -> &StageName;

    fn policy(&self) -> &StagePolicy;

    /// Work that takes long and writes nothing (an LLM call, a download), done after
    /// the claim and outside any transaction while the lease is renewed. Its result
    /// is handed to `run`. Default: nothing to prepare.
    async fn prepare(&self, _job: &StageJob) -> Result<serde_json::Value, StageError> {
        Ok(serde_json::Value::Null)
    }

    /// The stage's writes, inside the fenced transaction: they commit together with
    /// `status = 'success'` or not at all. May run more than once if the transaction
    /// is retried after a serialization failure or deadlock.
    async fn run(
        &self,
        job: &StageJob,
        prepared: &serde_json::Value,
        tx: &mut FencedTx<'_>,
    ) -> Result<StageFlow, StageError>;
}
