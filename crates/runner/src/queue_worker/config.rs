//! A queue worker's settings, and the check of which settings work.

use std::time::Duration;

use idemstage_domain::queue::validate_queue_name;
use idemstage_persistence::queue::{LeaseCommit, MaintenanceConfig};

/// The most jobs a worker may hold at once (`concurrency + prefetch`): more would
/// claim a queue's backlog away from every other worker, and make the release at
/// shutdown long.
pub const MAX_HELD_JOBS: usize = 100_000;

/// Settings of a [`QueueWorker`](super::QueueWorker). Durations are measured by the
/// worker's clock (tokio time); job leases and retry times are the database's.
///
/// Built with [`for_queues`](Self::for_queues) (or from the default) and the
/// `with_` methods, or by setting a field of such a value, so that a setting
/// added later breaks no caller (the struct is `#[non_exhaustive]`):
///
/// ```
/// use std::time::Duration;
/// use idemstage::worker::QueueWorkerConfig;
/// let config = QueueWorkerConfig::for_queues(["emails"])
///     .with_concurrency(16)
///     .with_prefetch(256)
///     .with_poll_interval(Duration::from_millis(500));
/// assert!(config.validate().is_ok());
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct QueueWorkerConfig {
    /// The queues to fetch from; at least one (`PipelineWorker` fills in its stages).
    pub queues: Vec<String>,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Jobs leased per fetch, at most: a fetch takes no more than the room left
    /// for `concurrency + prefetch` jobs.
    pub batch_size: u32,
    /// Jobs fetched ahead, beyond those running: they wait in the worker for a free
    /// handler slot, so a slot that frees up starts its next job without a round
    /// trip. The worker fetches again when half of them are left (with 0: when a
    /// slot is free and nothing waits), and never holds more than `concurrency +
    /// prefetch` jobs. Their leases are renewed while they wait, and at shutdown
    /// they are given back at once (not counted as a failure). For short handlers
    /// a prefetch of a few hundred lets a worker fetch in batches; with long
    /// handlers keep it small, since jobs waiting here are out of other workers'
    /// reach. Default 0: only the jobs that can start are fetched.
    pub prefetch: usize,
    /// How a fetch's commit, the one that takes the jobs' leases, waits for the
    /// write-ahead log. Default [`LeaseCommit::Asynchronous`]: a fetch does not
    /// wait for a fsync, at the cost of a job running once more if the server
    /// crashes within moments of the fetch (the type's docs say when); a
    /// [`PipelineWorker`](crate::PipelineWorker)'s stage bodies are not affected.
    pub lease_commit: LeaseCommit,
    /// Fallback when no notification arrives (missed, or a delayed retry came due).
    pub poll_interval: Duration,
    /// Wake on LISTEN/NOTIFY; without it the worker only polls.
    pub listen: bool,
    /// How often queue maintenance runs (the first run at start): it puts jobs
    /// whose lease ran out back in the queue, so keep it below the jobs' lease.
    /// One worker per database maintains at a time.
    pub maintenance_interval: Duration,
    /// What a maintenance run does: retention of finished jobs, batch size.
    pub maintenance: MaintenanceConfig,
    /// How often the ready floors are advanced (one worker per database at a
    /// time): the fetch reads each lane of ready jobs from its floor, so that a
    /// snapshot held elsewhere does not make it walk the jobs leased since. A
    /// deferred job that comes due below its lane's floor waits for the next
    /// run at most. The first run is one interval after the worker starts.
    pub floors_interval: Duration,
    /// On shutdown, how long in-flight handlers may finish; after that they are
    /// aborted and their jobs given back (`retry_now`, not counted as a failure).
    pub shutdown_grace: Duration,
    /// Backoff after a database error: doubles from `min` up to `max`.
    pub error_backoff_min: Duration,
    /// The longest backoff after a database error.
    pub error_backoff_max: Duration,
    /// A handler still running after this long is aborted and its job failed
    /// (retryable). `None`: no limit here (stages have their own timeout).
    pub handler_timeout: Option<Duration>,
    /// How often to sample the depth of this worker's queues from the database
    /// (one statement for all of them) into the gauges `idemstage_queue_depth` and
    /// `idemstage_queue_oldest_ready_age_seconds` (see [`crate::telemetry`]).
    /// `None` (the default): never, for a binary that installs no metrics recorder.
    pub queue_gauges_interval: Option<Duration>,
}

impl Default for QueueWorkerConfig {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            concurrency: 4,
            batch_size: 10,
            prefetch: 0,
            lease_commit: LeaseCommit::default(),
            poll_interval: Duration::from_secs(2),
            listen: true,
            maintenance_interval: Duration::from_secs(30),
            maintenance: MaintenanceConfig::default(),
            floors_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(30),
            error_backoff_min: Duration::from_millis(100),
            error_backoff_max: Duration::from_secs(10),
            handler_timeout: None,
            queue_gauges_interval: None,
        }
    }
}

impl QueueWorkerConfig {
    /// The default settings, working `queues`.
    pub fn for_queues<Q: Into<String>>(queues: impl IntoIterator<Item = Q>) -> Self {
        Self::default().with_queues(queues)
    }

    /// The same, working `queues`.
    pub fn with_queues<Q: Into<String>>(mut self, queues: impl IntoIterator<Item = Q>) -> Self {
        self.queues = queues.into_iter().map(Into::into).collect();
        self
    }

    /// The same, running at most `concurrency` handlers at once.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// The same, leasing at most `batch_size` jobs per fetch.
    pub fn with_batch_size(mut self, batch_size: u32) -> Self {
        self.batch_size = batch_size;
        self
    }

    /// The same, fetching `prefetch` jobs ahead of the running ones.
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// The same, committing a fetch's leases as `commit` says.
    pub fn with_lease_commit(mut self, commit: LeaseCommit) -> Self {
        self.lease_commit = commit;
        self
    }

    /// The same, polling every `interval` when no notification arrives.
    pub fn with_poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The same, waking on LISTEN/NOTIFY (`true`) or only polling.
    pub fn with_listen(mut self, listen: bool) -> Self {
        self.listen = listen;
        self
    }

    /// The same, running queue maintenance every `interval`.
    pub fn with_maintenance_interval(mut self, interval: Duration) -> Self {
        self.maintenance_interval = interval;
        self
    }

    /// The same, its maintenance runs limited by `maintenance`.
    pub fn with_maintenance(mut self, maintenance: MaintenanceConfig) -> Self {
        self.maintenance = maintenance;
        self
    }

    /// The same, advancing the ready floors every `interval`.
    pub fn with_floors_interval(mut self, interval: Duration) -> Self {
        self.floors_interval = interval;
        self
    }

    /// The same, letting in-flight handlers finish for `grace` at shutdown.
    pub fn with_shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// The same, backing off from `min` to `max` after database errors.
    pub fn with_error_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.error_backoff_min = min;
        self.error_backoff_max = max;
        self
    }

    /// The same, aborting (and failing, retryable) a handler after `timeout`.
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = Some(timeout);
        self
    }

    /// The same, sampling its queues' depth into the gauges every `interval`.
    pub fn with_queue_gauges_interval(mut self, interval: Duration) -> Self {
        self.queue_gauges_interval = Some(interval);
        self
    }

    /// Checks the settings ([`QueueWorker::new`](super::QueueWorker::new) does):
    /// refused without queues, with an invalid queue name, with a zero
    /// `concurrency`, `batch_size`, `poll_interval`, `maintenance_interval` or
    /// `queue_gauges_interval`, or
    /// with `concurrency + prefetch` above [`MAX_HELD_JOBS`]. The error names the
    /// setting.
    pub fn validate(&self) -> Result<(), WorkerError> {
        if self.queues.is_empty() {
            return Err(WorkerError::Config("no queues to work".into()));
        }
        for q in &self.queues {
            validate_queue_name(q).map_err(|e| WorkerError::Config(e.to_string()))?;
        }
        if self.concurrency == 0 || self.batch_size == 0 {
            return Err(WorkerError::Config(
                "concurrency and batch_size must be positive".into(),
            ));
        }
        if self.poll_interval.is_zero()
            || self.maintenance_interval.is_zero()
            || self.floors_interval.is_zero()
        {
            return Err(WorkerError::Config(
                "poll_interval, maintenance_interval and floors_interval must be positive".into(),
            ));
        }
        if self.queue_gauges_interval.is_some_and(|i| i.is_zero()) {
            return Err(WorkerError::Config(
                "queue_gauges_interval must be positive".into(),
            ));
        }
        if self.held_limit() > MAX_HELD_JOBS {
            return Err(WorkerError::Config(format!(
                "concurrency {} + prefetch {} is more than the {MAX_HELD_JOBS} jobs a \
                 worker may hold",
                self.concurrency, self.prefetch
            )));
        }
        Ok(())
    }

    /// The most jobs the worker holds at once: running and fetched ahead.
    pub(super) fn held_limit(&self) -> usize {
        self.concurrency.saturating_add(self.prefetch)
    }
}

/// Why a worker could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The configuration is invalid (the text says which setting); fix it, do not retry.
    #[error("invalid worker configuration: {0}")]
    Config(String),
}
