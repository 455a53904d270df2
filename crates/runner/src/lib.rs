//! The runner library: the generic queue worker loop, and the stage worker built on
//! it. The `idemstage` binary in `main.rs` wires them to the CLI.

pub mod pipeline_worker;
pub mod queue_worker;

pub use pipeline_worker::{Counters, CountersSnapshot, PipelineWorker, PipelineWorkerConfig};
pub use queue_worker::{
    handler_fn, FnHandler, Handled, HandlerError, JobHandler, QueueWorker, QueueWorkerConfig,
    WorkerError, WorkerStats, WorkerStatsSnapshot,
};
