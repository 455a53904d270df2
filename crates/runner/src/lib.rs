//! The runner library: the generic queue worker loop (and, later, the stage worker
//! pool built on it). The `idemstage` binary in `main.rs` wires it to the CLI.

pub mod queue_worker;

pub use queue_worker::{
    handler_fn, FnHandler, HandlerError, JobHandler, QueueWorker, QueueWorkerConfig, WorkerError,
    WorkerStats, WorkerStatsSnapshot,
};
