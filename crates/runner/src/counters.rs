//! Outcome counts of stage executions, shared by stage workers (the demo shares
//! one across its workers).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;

/// Outcome counts across one or more stage workers (the demo shares one): one
/// count per execution, by its `ExecutionOutcome`. Read them with
/// [`Counters::snapshot`]; `Counters::default()` is what a worker usually gets.
#[derive(Debug, Default)]
pub struct Counters {
    /// Executions that committed the stage's success.
    pub succeeded: AtomicU64,
    /// Executions that found the stage succeeded already (its job completed).
    pub skipped: AtomicU64,
    /// Executions that found the stage held by another worker, or its upstream
    /// without a current success (the job deferred).
    pub deferred: AtomicU64,
    /// Executions whose claim refused the job's input.
    pub rejected: AtomicU64,
    /// Executions that lost their lease, or whose upstream changed, before commit.
    pub fenced: AtomicU64,
    /// Attempts interrupted by a database error (released, not counted).
    pub interrupted: AtomicU64,
    /// Attempts whose body said it was rate limited (released, not counted).
    pub rate_limited: AtomicU64,
    /// Attempts that failed and will be retried.
    pub failed: AtomicU64,
    /// Attempts that failed for good: the run is `dead`.
    pub dead: AtomicU64,
    /// Claims refused because the stage's `max_attempts` was used up already.
    pub exhausted: AtomicU64,
    /// Successes per (tenant, item, stage) as reported to workers: more than one
    /// for a key would be a double execution seen from the outside. Only kept when
    /// asked for (demo, tests): a long-running worker would grow it without end.
    pub(crate) successes: Option<Mutex<HashMap<String, u32>>>,
}

/// The values of [`Counters`] at one moment.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CountersSnapshot {
    /// [`Counters::succeeded`].
    pub succeeded: u64,
    /// [`Counters::skipped`].
    pub skipped: u64,
    /// [`Counters::deferred`].
    pub deferred: u64,
    /// [`Counters::rejected`].
    pub rejected: u64,
    /// [`Counters::fenced`].
    pub fenced: u64,
    /// [`Counters::interrupted`].
    pub interrupted: u64,
    /// [`Counters::rate_limited`].
    pub rate_limited: u64,
    /// [`Counters::failed`].
    pub failed: u64,
    /// [`Counters::dead`].
    pub dead: u64,
    /// [`Counters::exhausted`].
    pub exhausted: u64,
}

impl Counters {
    /// The counts now (each read on its own: not one consistent instant).
    pub fn snapshot(&self) -> CountersSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CountersSnapshot {
            succeeded: g(&self.succeeded),
            skipped: g(&self.skipped),
            deferred: g(&self.deferred),
            rejected: g(&self.rejected),
            fenced: g(&self.fenced),
            interrupted: g(&self.interrupted),
            rate_limited: g(&self.rate_limited),
            failed: g(&self.failed),
            dead: g(&self.dead),
            exhausted: g(&self.exhausted),
        }
    }

    /// Counters that also remember every key that succeeded, for
    /// `double_successes`.
    pub fn tracking_successes() -> Self {
        Self {
            successes: Some(Mutex::default()),
            ..Self::default()
        }
    }

    /// Keys for which more than one execution reported success.
    ///
    /// # Panics
    /// Without `tracking_successes` there is nothing to count: asking is a bug.
    pub fn double_successes(&self) -> u64 {
        self.successes
            .as_ref()
            .expect("double_successes needs Counters::tracking_successes()")
            .lock()
            .unwrap()
            .values()
            .filter(|&&n| n > 1)
            .count() as u64
    }

    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}
