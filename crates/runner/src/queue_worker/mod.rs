//! A generic worker for the job queue: fetches batches (optionally ahead of free
//! slots), runs a handler per job with bounded concurrency, completes each job in
//! batches or fails it, always under its fencing token, keeps the leases of all its
//! jobs with one renewal statement, wakes on LISTEN/NOTIFY with a polling fallback,
//! runs queue maintenance, survives handler panics and database outages, and shuts
//! down gracefully.
//!
//! One file per part: `config.rs` the settings, `dispatch.rs` the fetch loop and
//! the buffer of fetched jobs, `job.rs` one job's task, `completer.rs` the batched
//! completions, `lease.rs` the lease keeper, `listener.rs`, `maintenance.rs`,
//! `stats.rs`.

mod completer;
mod config;
mod dispatch;
mod handler;
mod job;
mod lease;
mod listener;
mod maintenance;
mod stats;

use std::sync::Arc;

use idemstage_persistence::PgPool;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use config::{QueueWorkerConfig, WorkerError, MAX_HELD_JOBS};
pub use handler::{handler_fn, FnHandler, Handled, HandlerError, JobHandler};
pub use stats::{WorkerStats, WorkerStatsSnapshot};

use completer::Completer;
use dispatch::Dispatch;
use job::JobContext;
use lease::Leases;
use listener::listen_loop;
use maintenance::{floors_loop, maintenance_loop, queue_gauges_loop};

/// A worker for any job queue: runs `H` for each job of its queues, at most
/// `concurrency` at once, and completes or fails each job under its lease. A job
/// is at-least-once: a handler may see it again after a crash or a lost lease, so
/// make handlers idempotent. For a pipeline's stages use `PipelineWorker`.
///
/// ```no_run
/// use idemstage::queue::{send, FetchedJob, JobToSend};
/// use idemstage::serde_json::{json, Value};
/// use idemstage::db::PgPool;
/// use idemstage::queue::SendOptions;
/// use idemstage::worker::{
///     handler_fn, CancellationToken, HandlerError, QueueWorker, QueueWorkerConfig,
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
/// let config = QueueWorkerConfig::for_queues(["emails"]);
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
    handler: H,
    stats: Arc<WorkerStats>,
}

impl<H: JobHandler> QueueWorker<H> {
    /// A worker running `handler` on `config.queues`. `database_url` is for the
    /// LISTEN connection, which cannot be pooled. Refused (`WorkerError::Config`)
    /// if the settings are invalid (see [`QueueWorkerConfig::validate`]). Nothing
    /// connects before [`run`](QueueWorker::run).
    pub fn new(
        pool: PgPool,
        database_url: impl Into<String>,
        config: QueueWorkerConfig,
        handler: H,
    ) -> Result<Self, WorkerError> {
        config.validate()?;
        Ok(Self {
            pool,
            database_url: database_url.into(),
            config,
            handler,
            stats: Arc::new(WorkerStats::default()),
        })
    }

    /// The live counters, for reading while [`run`](QueueWorker::run) works.
    pub fn stats(&self) -> Arc<WorkerStats> {
        self.stats.clone()
    }

    /// Works until `shutdown` is cancelled; then stops fetching, gives back at once
    /// the jobs it fetched but did not start, lets in-flight handlers finish for up
    /// to `shutdown_grace`, gives back the rest, records the completions handed to
    /// the completer, and returns the final counters. Database errors never end
    /// the loop.
    pub async fn run(self, shutdown: CancellationToken) -> WorkerStatsSnapshot {
        let cfg = self.config;
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
        background.spawn(floors_loop(
            self.pool.clone(),
            cfg.floors_interval,
            background_stop.clone(),
        ));
        if let Some(every) = cfg.queue_gauges_interval {
            background.spawn(queue_gauges_loop(
                self.pool.clone(),
                cfg.queues.clone(),
                every,
                background_stop.clone(),
            ));
        }
        let leases_stop = CancellationToken::new();
        let (leases, leases_done) = Leases::start(
            self.pool.clone(),
            self.stats.clone(),
            cfg.error_backoff_min,
            cfg.error_backoff_max,
            leases_stop.clone(),
        );
        let (completer, completer_done) =
            Completer::start(self.pool.clone(), self.stats.clone(), cfg.error_backoff_min);
        let cx = Arc::new(JobContext {
            pool: self.pool,
            completer,
            handler: self.handler,
            hard_stop: CancellationToken::new(),
            stats: self.stats.clone(),
            backoff_min: cfg.error_backoff_min,
            handler_timeout: cfg.handler_timeout,
        });

        let grace = cfg.shutdown_grace;
        let mut dispatch = Dispatch::new(cx, cfg, leases);
        dispatch.run(&shutdown, &wake).await;
        dispatch.release_unstarted().await;
        dispatch.drain(grace).await;
        // Every job task has ended, so this drops the last sender: the completer
        // records what it was handed, and stops.
        drop(dispatch);
        if let Err(e) = completer_done.await {
            tracing::error!(error = %e, "job completer failed");
        }
        leases_stop.cancel();
        if let Err(e) = leases_done.await {
            tracing::error!(error = %e, "job lease keeper failed");
        }
        background_stop.cancel();
        while background.join_next().await.is_some() {}
        self.stats.snapshot()
    }
}
