//! The runner library: the generic queue worker loop, and the stage worker built on
//! it. The `idemstage` command line (crate `idemstage-cli`) wires them to its
//! subcommands.

#![warn(missing_docs)]

pub mod counters;
pub mod pipeline_worker;
pub mod queue_worker;
pub mod telemetry;
pub mod worker_builder;

pub use counters::{Counters, CountersSnapshot};
pub use pipeline_worker::{PipelineWorker, PipelineWorkerConfig};
pub use queue_worker::{
    handler_fn, FnHandler, Handled, HandlerError, JobHandler, QueueWorker, QueueWorkerConfig,
    WorkerError, WorkerStats, WorkerStatsSnapshot,
};
pub use worker_builder::{PipelineWorkerBuilder, WorkerBuildError};
