//! The stage layer: the `Stage` trait, pipelines of stages, and the executor that
//! runs one stage execution: claim → skip or run → fenced commit (with the next
//! stage's job) or fail, renewing the lease while the body runs.
//!
//! Invariant: this crate names no table and no SQL. A stage body writes through the
//! fenced transaction handle (`FencedTx`) that `persistence` opens.

#![warn(missing_docs)]

mod contract;
mod erased;
mod executor;
mod ops;
mod pipeline;
mod reconcile;
mod start;
pub mod telemetry;

pub use contract::{AttemptInfo, Done, PrepareContext, Stage, StageData};
pub use erased::StageRef;
pub use executor::{ExecutionOutcome, Executor, JobLease};
pub use pipeline::{
    first_job, FanOutBuilder, Pipeline, PipelineBuilder, PipelineError, StageJob, StageRole,
};
pub use reconcile::{ReconcileReport, Reconciler};
pub use start::{start, start_in};

/// What the pipeline does after a stage succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum StageFlow {
    /// Send the next stage's job (in the same transaction), if there is one.
    Continue,
    /// The item ends here (e.g. infeasible): no further stage.
    Stop,
}
