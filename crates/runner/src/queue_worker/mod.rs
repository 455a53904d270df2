//! A generic worker for the job queue: fetches batches, runs a handler per job with
//! bounded concurrency, completes or fails each job under its fencing token, wakes
//! on LISTEN/NOTIFY with a polling fallback, runs queue maintenance, survives
//! handler panics and database outages, and shuts down gracefully.

mod completer;
mod handler;
mod job;
mod listener;
mod maintenance;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{FetchedJob, RepoError};
use idemstage_persistence::queue::{self, MaintenanceConfig};
use idemstage_persistence::PgPool;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use handler::{handler_fn, FnHandler, Handled, HandlerError, JobHandler};
pub use stats::{WorkerStats, WorkerStatsSnapshot};

use completer::Completer;
use job::run_job;
use listener::listen_loop;
use maintenance::maintenance_loop;

/// Settings of a [`QueueWorker`]. Durations are measured by the worker's clock
/// (tokio time); job leases and retry times are the database's.
#[derive(Clone, Debug)]
pub struct QueueWorkerConfig {
    /// The queues to fetch from; at least one (`PipelineWorker` fills in its stages).
    pub queues: Vec<String>,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Jobs leased per fetch (at most the free handler slots).
    pub batch_size: u32,
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
}

impl Default for QueueWorkerConfig {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            concurrency: 4,
            batch_size: 10,
            poll_interval: Duration::from_secs(2),
            listen: true,
            maintenance_interval: Duration::from_secs(30),
            maintenance: MaintenanceConfig::default(),
            shutdown_grace: Duration::from_secs(30),
            error_backoff_min: Duration::from_millis(100),
            error_backoff_max: Duration::from_secs(10),
            handler_timeout: None,
        }
    }
}

/// Why a worker could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The configuration is invalid (the text says which setting); fix it, do not retry.
    #[error("invalid worker configuration: {0}")]
    Config(String),
}

/// A worker for any job queue: runs `H` for each job of its queues, at most
/// `concurrency` at once, and completes or fails each job under its lease. A job
/// is at-least-once: a handler may see it again after a crash or a lost lease, so
/// make handlers idempotent. For a pipeline's stages use `PipelineWorker`.
///
/// ```no_run
/// use idemstage::queue::{send, FetchedJob, JobToSend};
/// use idemstage::serde_json::{json, Value};
/// use idemstage::{
///     handler_fn, CancellationToken, HandlerError, PgPool, QueueWorker, QueueWorkerConfig,
///     SendOptions,
/// };
///
/// # async fn demo(pool: PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let url = "postgres://localhost/app";
/// send(
///     &pool,
///     &JobToSend {
///         queue: "emails".into(),
///         tenant: None,
///         payload: json!({ "to": "a@example.com" }),
///         options: SendOptions::default(),
///     },
/// )
/// .await?;
///
/// // `Ok(())` completes the job; a payload the handler's type does not accept
/// // fails it for good before the handler is called.
/// let handler = handler_fn(|job: FetchedJob, payload: Value| async move {
///     let to = payload["to"]
///         .as_str()
///         .ok_or_else(|| HandlerError::permanent("no recipient"))?;
///     println!("job {} (delivery {}): mail to {to}", job.id, job.attempt);
///     Ok(())
/// });
/// let config = QueueWorkerConfig {
///     queues: vec!["emails".into()],
///     ..QueueWorkerConfig::default()
/// };
/// let worker = QueueWorker::new(pool, url, config, handler)?;
/// let shutdown = CancellationToken::new();
/// let stats = worker.run(shutdown).await;
/// println!("{} completed", stats.completed);
/// # Ok(())
/// # }
/// ```
pub struct QueueWorker<H> {
    pool: PgPool,
    database_url: String,
    config: QueueWorkerConfig,
    handler: Arc<H>,
    stats: Arc<WorkerStats>,
}

impl<H: JobHandler> QueueWorker<H> {
    /// A worker running `handler` on `config.queues`. `database_url` is for the
    /// LISTEN connection, which cannot be pooled. Refused (`WorkerError::Config`)
    /// without queues, with an invalid queue name, or a zero `concurrency`,
    /// `batch_size`, `poll_interval` or `maintenance_interval`. Nothing connects
    /// before [`run`](QueueWorker::run).
    pub fn new(
        pool: PgPool,
        database_url: impl Into<String>,
        config: QueueWorkerConfig,
        handler: H,
    ) -> Result<Self, WorkerError> {
        if config.queues.is_empty() {
            return Err(WorkerError::Config("no queues to work".into()));
        }
        for q in &config.queues {
            validate_queue_name(q).map_err(|e| WorkerError::Config(e.to_string()))?;
        }
        if config.concurrency == 0 || config.batch_size == 0 {
            return Err(WorkerError::Config(
                "concurrency and batch_size must be positive".into(),
            ));
        }
        if config.poll_interval.is_zero() || config.maintenance_interval.is_zero() {
            return Err(WorkerError::Config(
                "poll_interval and maintenance_interval must be positive".into(),
            ));
        }
        Ok(Self {
            pool,
            database_url: database_url.into(),
            config,
            handler: Arc::new(handler),
            stats: Arc::new(WorkerStats::default()),
        })
    }

    /// The live counters, for reading while [`run`](QueueWorker::run) works.
    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    /// Works until `shutdown` is cancelled; then stops fetching, lets in-flight
    /// handlers finish for up to `shutdown_grace`, gives back the rest, and returns
    /// the final counters. Database errors never end the loop.
    pub async fn run(self, shutdown: CancellationToken) -> WorkerStatsSnapshot {
        let cfg = &self.config;
        let wake = Arc::new(Notify::new());
        // Listener and maintenance stop after the handlers are drained.
        let background_stop = CancellationToken::new();
        let mut background = JoinSet::new();
        if cfg.listen {
            background.spawn(listen_loop(
                self.database_url.clone(),
                cfg.queues.clone(),
                wake.clone(),
                cfg.error_backoff_min,
                cfg.error_backoff_max,
                background_stop.clone(),
            ));
        }
        background.spawn(maintenance_loop(
            self.pool.clone(),
            cfg.maintenance.clone(),
            cfg.maintenance_interval,
            background_stop.clone(),
        ));

        let (completer, completer_done) = Completer::start(self.pool.clone());
        let slots = Arc::new(Semaphore::new(cfg.concurrency));
        let hard_stop = CancellationToken::new();
        let mut in_flight = JoinSet::new();
        let mut backoff = cfg.error_backoff_min;
        loop {
            while let Some(done) = in_flight.try_join_next() {
                if let Err(e) = done {
                    tracing::error!(error = %e, "job task failed");
                }
            }
            if shutdown.is_cancelled() {
                break;
            }
            let free = slots.available_permits();
            if free == 0 {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    permit = slots.clone().acquire_owned() => drop(permit),
                }
                continue;
            }
            let limit = u32::try_from(free).unwrap_or(u32::MAX).min(cfg.batch_size);
            match self.fetch(limit).await {
                Ok(jobs) => {
                    backoff = cfg.error_backoff_min;
                    let full = jobs.len() == limit as usize;
                    WorkerStats::add(&self.stats.fetched, jobs.len() as u64);
                    for job in jobs {
                        // Only this loop takes permits, so the `free` counted above
                        // are still there.
                        let Ok(permit) = slots.clone().try_acquire_owned() else {
                            unreachable!("a counted free slot disappeared");
                        };
                        in_flight.spawn(run_job(
                            self.pool.clone(),
                            completer.clone(),
                            self.handler.clone(),
                            job,
                            permit,
                            hard_stop.clone(),
                            self.stats.clone(),
                            cfg.error_backoff_min,
                            cfg.handler_timeout,
                        ));
                    }
                    if full {
                        // More may be waiting: fetch again as soon as a slot is free.
                        continue;
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = wake.notified() => {}
                        _ = tokio::time::sleep(cfg.poll_interval) => {}
                    }
                }
                Err(e) => {
                    WorkerStats::add(&self.stats.fetch_errors, 1);
                    tracing::warn!(error = %e, retry_in = ?backoff, "fetch failed");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(cfg.error_backoff_max);
                }
            }
        }

        let drain = async {
            while let Some(done) = in_flight.join_next().await {
                if let Err(e) = done {
                    tracing::error!(error = %e, "job task failed");
                }
            }
        };
        if tokio::time::timeout(cfg.shutdown_grace, drain)
            .await
            .is_err()
        {
            tracing::warn!(
                grace = ?cfg.shutdown_grace,
                still_running = in_flight.len(),
                "shutdown grace period over; giving the remaining jobs back"
            );
            hard_stop.cancel();
            while in_flight.join_next().await.is_some() {}
        }
        // Every job task has ended, so this was the last sender.
        drop(completer);
        if let Err(e) = completer_done.await {
            tracing::error!(error = %e, "job completer failed");
        }
        background_stop.cancel();
        while background.join_next().await.is_some() {}
        self.stats.snapshot()
    }

    async fn fetch(&self, limit: u32) -> Result<Vec<FetchedJob>, RepoError> {
        let mut conn = idemstage_persistence::get(&self.pool).await?;
        queue::fetch(&mut conn, &self.config.queues, limit).await
    }
}
