//! The stage worker: a `QueueWorker` over a pipeline's stage queues whose handler
//! runs the executor and turns each `ExecutionOutcome` into what happens to the job.
//!
//! The rule that keeps stages from being lost: while a stage is not final, at least
//! one live job for it exists. A job is completed only when its stage is final
//! (succeeded, dead, or found succeeded); a stage that someone else holds defers
//! the job until that holder's lease runs out. A job whose stage succeeds is
//! completed in the stage's own fenced transaction (`Executor::run_and_complete_job`), so the
//! two commit together.

use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::WorkerId;
use idemstage_persistence::queue::Wake;
use idemstage_persistence::{PgPool, PgRunRepository};
use idemstage_stage::{Executor, Pipeline, Reconciler};
use tokio_util::sync::CancellationToken;

mod handler;

use handler::PipelineHandler;

use crate::{Counters, QueueWorker, QueueWorkerConfig, WorkerError, WorkerStatsSnapshot};

/// Settings of a [`PipelineWorker`]. The default: 4 executions at once, on every
/// stage queue of the pipeline, with [`QueueWorkerConfig::default`]'s loop.
/// Built from the default with the `with_` methods (the struct is
/// `#[non_exhaustive]`); see [`PipelineWorker::new`] for an example, or set them
/// on [`PipelineWorker::builder`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PipelineWorkerConfig {
    /// Stage executions at once.
    pub concurrency: usize,
    /// The queue loop's settings; `queues` empty means every stage of the pipeline.
    pub queue: QueueWorkerConfig,
    /// When the next stage's job, sent in a stage's commit, wakes the workers of
    /// its queue. The default, [`Wake::AfterCommit`], keeps the NOTIFY out of the
    /// stage's commit: PostgreSQL serializes notifying commits, which caps a busy
    /// pipeline (BENCHMARKS.md, "NOTIFY under load").
    pub wake: Wake,
    /// How often the worker's [`Reconciler`] looks for stages that are expected,
    /// not final and without a live job (a job deleted by hand, or failed while
    /// its stage was not), and sends their jobs again: each interval it looks
    /// at every open item, a batch a pass; the first interval ends one interval
    /// after the start. Default 30 s; `None`: never (another worker's
    /// reconciler must run then). Several workers reconciling at once is
    /// harmless: a second send is a `Duplicate`.
    pub reconcile_interval: Option<Duration>,
    /// The most open items one reconciler pass (a transaction per tenant of
    /// the batch) looks at (default 1000); an interval runs as many passes as
    /// there are open items.
    pub reconcile_batch_limit: u32,
    /// How often the worker ends the durable waits past their deadline
    /// (`waits::expire_due`: one index probe when none is due), so that a
    /// wait's timeout or a timer is kept to within this (default 1 s; `None`:
    /// never, another worker's must; several at once are harmless, each wait
    /// ends once).
    pub wait_interval: Option<Duration>,
}

impl PipelineWorkerConfig {
    /// The same, running at most `concurrency` stage executions at once.
    pub fn with_concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// The same, with `queue` as the queue loop's settings.
    pub fn with_queue(mut self, queue: QueueWorkerConfig) -> Self {
        self.queue = queue;
        self
    }

    /// The same, waking the next stage's workers as `wake` says.
    pub fn with_wake(mut self, wake: Wake) -> Self {
        self.wake = wake;
        self
    }

    /// The same, reconciling every `interval` (`None`: never).
    pub fn with_reconcile_interval(mut self, interval: Option<Duration>) -> Self {
        self.reconcile_interval = interval;
        self
    }

    /// The same, ending waits past their deadline every `interval` (`None`:
    /// never).
    pub fn with_wait_interval(mut self, interval: Option<Duration>) -> Self {
        self.wait_interval = interval;
        self
    }

    /// The same, looking at most at `limit` open items per reconciler pass.
    pub fn with_reconcile_batch_limit(mut self, limit: u32) -> Self {
        self.reconcile_batch_limit = limit;
        self
    }

    /// The pool size a worker with this config needs: per stage execution, its
    /// connection and its heartbeat's, plus the loop's, the completer's and the
    /// notifier's (the job lease keeper borrows one briefly, for one statement for
    /// all jobs, and so does the waits' loop), and one for the queue gauges' sampler if it runs. A smaller pool
    /// makes executions wait for connections (and time out).
    pub fn pool_size(&self) -> u32 {
        let gauges = usize::from(self.queue.queue_gauges_interval.is_some());
        u32::try_from(self.concurrency * 2 + 3 + gauges).unwrap_or(u32::MAX)
    }
}

impl Default for PipelineWorkerConfig {
    fn default() -> Self {
        Self {
            concurrency: 4,
            queue: QueueWorkerConfig::default(),
            wake: Wake::default(),
            reconcile_interval: Some(DEFAULT_RECONCILE_INTERVAL),
            reconcile_batch_limit: Reconciler::DEFAULT_BATCH_LIMIT,
            wait_interval: Some(DEFAULT_WAIT_INTERVAL),
        }
    }
}

/// How often a `PipelineWorker` reconciles by default.
pub const DEFAULT_RECONCILE_INTERVAL: Duration = Duration::from_secs(30);

/// How often a `PipelineWorker` ends the waits past their deadline by default.
pub const DEFAULT_WAIT_INTERVAL: Duration = Duration::from_secs(1);

/// How long a stopping worker waits for the releases of its aborted stages.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// A worker for the stage queues of one pipeline: fetches stage jobs, runs each
/// through an [`Executor`], and completes, defers or fails the job by the outcome
/// (a job is completed only once its stage is final). Run as many as you like, in
/// as many processes: the database coordinates them.
pub struct PipelineWorker {
    inner: QueueWorker<PipelineHandler>,
    worker_id: WorkerId,
    /// A clone of the handler's, for the releases at shutdown.
    executor: Executor,
    /// The reconciler and its interval, if it runs.
    reconciler: Option<(Reconciler, Duration, PgPool)>,
    /// The pipeline, its interval and pool for the waits' deadlines, if they run.
    waits: Option<(Pipeline, Duration, PgPool)>,
    /// The handler's counters.
    counters: Arc<Counters>,
}

impl PipelineWorker {
    /// A worker for `pipeline` on `pool` (which needs at least
    /// [`PipelineWorkerConfig::pool_size`] connections, not checked here: the
    /// [`builder`](Self::builder) checks it, or builds the pool); `database_url` is for its
    /// LISTEN connection, which cannot be pooled. `counters` may be shared between
    /// workers. Refused (`WorkerError::Config`) if a configured queue is not a stage
    /// of the pipeline, the queue loop's settings are invalid,
    /// `maintenance_interval` is longer than the pipeline's job lease (`expire_in`),
    /// or `reconcile_interval` is zero.
    /// Nothing connects before [`run`](PipelineWorker::run).
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use std::time::Duration;
    ///
    /// use idemstage::db::PoolConfig;
    /// use idemstage::pipeline::Pipeline;
    /// use idemstage::worker::{
    ///     CancellationToken, Counters, PipelineWorker, PipelineWorkerConfig, QueueWorkerConfig,
    /// };
    ///
    /// # async fn demo(pipeline: Pipeline) -> Result<(), Box<dyn std::error::Error>> {
    /// let url = "postgres://localhost/app";
    /// let config = PipelineWorkerConfig::default()
    ///     .with_concurrency(8)
    ///     .with_queue(QueueWorkerConfig::default().with_shutdown_grace(Duration::from_secs(10)));
    /// let pool = idemstage::db::connect_pool(
    ///     url,
    ///     PoolConfig::default().with_max_size(config.pool_size()),
    /// )
    /// .await?;
    /// let counters = Arc::new(Counters::default());
    /// let worker = PipelineWorker::new(pool, url, pipeline, config, counters.clone())?;
    ///
    /// // Cancel the token (on SIGTERM, say) to stop: `run` returns once in-flight
    /// // stages finished or, after the grace, were given back.
    /// let shutdown = CancellationToken::new();
    /// let stats = worker.run(shutdown).await;
    /// println!("{} jobs fetched, {} stages succeeded", stats.fetched, counters.snapshot().succeeded);
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(
        pool: PgPool,
        database_url: &str,
        pipeline: Pipeline,
        config: PipelineWorkerConfig,
        counters: Arc<Counters>,
    ) -> Result<Self, WorkerError> {
        let worker_id = WorkerId::generate();
        let queue = Self::check_config(&pipeline, &config)?;
        let executor = Executor::new(
            Arc::new(PgRunRepository::new(pool.clone()).with_wake(config.wake)),
            worker_id.clone(),
        );
        let reconciler = config.reconcile_interval.map(|every| {
            // Half an interval: workers whose intervals start together take
            // turns at the ring instead of passing the same slots at once.
            let reconciler = Reconciler::new(pipeline.clone())
                .with_batch_limit(config.reconcile_batch_limit)
                .with_rotation_age(every / 2);
            (reconciler, every, pool.clone())
        });
        let waits = config
            .wait_interval
            .map(|every| (pipeline.clone(), every, pool.clone()));
        let handler = PipelineHandler {
            pipeline,
            executor: executor.clone(),
            counters: counters.clone(),
        };
        Ok(Self {
            inner: QueueWorker::new(pool, database_url, queue, handler)?,
            worker_id,
            executor,
            reconciler,
            waits,
            counters,
        })
    }

    /// The queue loop's settings of a worker for `pipeline` with `config` (its
    /// queues filled in), or why they do not work together (see [`new`](Self::new)).
    pub(crate) fn check_config(
        pipeline: &Pipeline,
        config: &PipelineWorkerConfig,
    ) -> Result<QueueWorkerConfig, WorkerError> {
        let mut queue = config.queue.clone();
        queue.concurrency = config.concurrency;
        if queue.queues.is_empty() {
            queue.queues = pipeline
                .stages()
                .iter()
                .map(|s| s.name().as_str().to_owned())
                .collect();
        }
        for q in &queue.queues {
            pipeline
                .stage(q)
                .map_err(|e| WorkerError::Config(e.to_string()))?;
        }
        // An expired job lease (a dead worker's job) comes back only through
        // maintenance: maintenance that runs less often than a lease lasts leaves
        // such jobs waiting for longer than their lease promises.
        let job_lease = pipeline.send_options().expire_in;
        if queue.maintenance_interval > job_lease {
            return Err(WorkerError::Config(format!(
                "maintenance_interval {:?} is longer than the pipeline's job lease {job_lease:?}: \
                 a dead worker's jobs would wait past their lease",
                queue.maintenance_interval
            )));
        }
        if config.reconcile_interval == Some(Duration::ZERO) {
            return Err(WorkerError::Config(
                "reconcile_interval must be positive (None: no reconciler)".into(),
            ));
        }
        if config.wait_interval == Some(Duration::ZERO) {
            return Err(WorkerError::Config(
                "wait_interval must be positive (None: this worker ends no waits)".into(),
            ));
        }
        queue.validate()?;
        Ok(queue)
    }

    /// The counters this worker adds to (those given to it, or its own).
    pub fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    /// This worker's identity, as recorded on the runs it claims (generated anew
    /// for every worker).
    pub fn worker_id(&self) -> &WorkerId {
        &self.worker_id
    }

    /// Works until `shutdown` is cancelled; then, after the queue worker's grace
    /// (`shutdown_grace`), waits briefly (at most 5 s) for the stages of aborted
    /// executions to be released, and returns the queue loop's counters. Database
    /// errors never end it. See [`PipelineWorker::new`] for an example.
    pub async fn run(self, shutdown: CancellationToken) -> WorkerStatsSnapshot {
        let reconciling = self.reconciler.map(|(reconciler, every, pool)| {
            tokio::spawn(reconcile_loop(reconciler, every, pool, shutdown.clone()))
        });
        let waiting = self.waits.map(|(pipeline, every, pool)| {
            tokio::spawn(waits_loop(pipeline, every, pool, shutdown.clone()))
        });
        let stats = self.inner.run(shutdown).await;
        for task in [reconciling, waiting].into_iter().flatten() {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "reconciler or waits' loop failed");
            }
        }
        self.executor.finish_releases(RELEASE_WAIT).await;
        stats
    }
}

/// The waits of `pipeline`'s stages past their deadline ended every `every`,
/// until `stop`; a failed pass is logged and the next one tries again.
async fn waits_loop(pipeline: Pipeline, every: Duration, pool: PgPool, stop: CancellationToken) {
    let stages: Vec<_> = pipeline.stages().iter().map(|s| s.name().clone()).collect();
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ended = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            idemstage_persistence::waits::expire_due(&mut conn, &stages, &pipeline, 1000).await
        }
        .await;
        match ended {
            Ok(e) if e.failed + e.resumed + e.gone > 0 => {
                tracing::info!(
                    failed = e.failed,
                    resumed = e.resumed,
                    gone = e.gone,
                    "waits past their deadline ended"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "ending waits past their deadline failed"),
        }
    }
}

/// Every `every`, reconciler passes back to back to the end of a round (the
/// ring of open items moved on, every older slot passed and truncated; the
/// first interval ends one interval after the start: at the start every job
/// is where the last worker left it, and maintenance brings back the expired
/// ones first), until `stop`. One pass an interval settled at most a batch: a
/// pipeline opening items faster than that grew `items_open` without bound.
/// A failed pass is logged and ends the interval's passes; the next interval
/// goes on from the batch after it (the slot of the failed batch is passed
/// again next round before it is truncated).
async fn reconcile_loop(
    mut reconciler: Reconciler,
    every: Duration,
    pool: PgPool,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        while !stop.is_cancelled() {
            match reconciler.pass(&pool).await {
                Ok(report) => {
                    if report.resent + report.settled > 0 {
                        tracing::info!(?report, "reconciler");
                    }
                    if report.last_batch {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reconciler pass failed");
                    break;
                }
            }
        }
    }
}
