//! The worker's counters.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of a running worker, readable while it runs.
#[derive(Debug, Default)]
pub struct WorkerStats {
    pub(super) fetched: AtomicU64,
    pub(super) completed: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) fenced: AtomicU64,
    pub(super) released: AtomicU64,
    pub(super) deferred: AtomicU64,
    pub(super) fetch_errors: AtomicU64,
    pub(super) leases_lost: AtomicU64,
}

/// A worker's counters at one moment (what [`QueueWorker::run`](super::QueueWorker::run)
/// returns at the end).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStatsSnapshot {
    /// Jobs fetched (leased).
    pub fetched: u64,
    /// Jobs completed, by the worker or by the handler's own transaction.
    pub completed: u64,
    /// Failures recorded (retrying or final).
    pub failed: u64,
    /// Completions or failures refused because the lease had been taken over.
    pub fenced: u64,
    /// Jobs given back unfinished at shutdown.
    pub released: u64,
    /// Jobs given back to wait (HandlerError::Defer).
    pub deferred: u64,
    /// Fetches that failed with a database error (retried after a backoff).
    pub fetch_errors: u64,
    /// Held jobs (running or waiting for a slot) whose lease renewal found them
    /// taken over; counted once the holder has been told, so that its handler is
    /// stopped or never started from then on.
    pub leases_lost: u64,
}

impl WorkerStats {
    /// The counts now.
    pub fn snapshot(&self) -> WorkerStatsSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WorkerStatsSnapshot {
            fetched: get(&self.fetched),
            completed: get(&self.completed),
            failed: get(&self.failed),
            fenced: get(&self.fenced),
            released: get(&self.released),
            deferred: get(&self.deferred),
            fetch_errors: get(&self.fetch_errors),
            leases_lost: get(&self.leases_lost),
        }
    }
    pub(super) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}
