//! [`PipelineWorker::builder`]: a stage worker from a URL and a pipeline, its pool
//! sized (or checked) for its concurrency.

use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::RepoError;
use idemstage_persistence::queue::Wake;
use idemstage_persistence::{connect_pool, PgPool, PoolConfig};
use idemstage_stage::Pipeline;

use crate::{Counters, PipelineWorker, PipelineWorkerConfig, QueueWorkerConfig, WorkerError};

/// Why [`PipelineWorkerBuilder::build`] refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerBuildError {
    /// The pool given holds fewer connections than the worker needs
    /// ([`PipelineWorkerConfig::pool_size`]): its executions would wait for
    /// connections and time out. Give a larger pool, a lower concurrency, or no
    /// pool (the builder then makes one of the right size).
    #[error(
        "the pool holds at most {pool_size} connections, but a worker running {concurrency} \
         stage executions at once needs {needed} (2 per execution + {fixed} for the worker \
         itself); give a pool of at least {needed} or lower the concurrency"
    )]
    PoolTooSmall {
        /// The pool's `max_size`.
        pool_size: u32,
        /// The connections the worker needs.
        needed: u32,
        /// The stage executions at once.
        concurrency: usize,
        /// The connections of the worker itself (loop, completer, notifier, and
        /// the queue gauges' sampler if it runs).
        fixed: u32,
    },
    /// The settings do not work together (see [`PipelineWorker::new`]).
    #[error(transparent)]
    Config(#[from] WorkerError),
    /// The pool could not be built: the database is unreachable (retryable as
    /// [`RepoError::is_retryable`] says).
    #[error("cannot open the worker's pool: {0}")]
    Pool(#[from] RepoError),
}

/// Builds a [`PipelineWorker`] (see [`PipelineWorker::builder`]). Every setting
/// has a default: [`PipelineWorkerConfig::default`], fresh [`Counters`], and a
/// pool built for the concurrency.
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct PipelineWorkerBuilder {
    database_url: String,
    pipeline: Pipeline,
    config: PipelineWorkerConfig,
    counters: Option<Arc<Counters>>,
    pool: Option<PgPool>,
    pool_config: Option<PoolConfig>,
}

impl PipelineWorker {
    /// A builder of a worker for `pipeline`. `database_url` is for the worker's
    /// LISTEN connection (which cannot be pooled) and, unless a pool is given, for
    /// its pool, which is then built with the connections the concurrency needs.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// use idemstage::{worker::CancellationToken, pipeline::Pipeline, worker::PipelineWorker};
    ///
    /// # async fn demo(pipeline: Pipeline) -> Result<(), Box<dyn std::error::Error>> {
    /// let worker = PipelineWorker::builder("postgres://localhost/app", pipeline)
    ///     .concurrency(8)
    ///     .shutdown_grace(Duration::from_secs(10))
    ///     .build()
    ///     .await?;
    /// let counters = worker.counters().clone();
    ///
    /// // Cancel the token (on SIGTERM, say) to stop: `run` returns once in-flight
    /// // stages finished or, after the grace, were given back.
    /// let shutdown = CancellationToken::new();
    /// let stats = worker.run(shutdown).await;
    /// println!("{} jobs fetched, {} stages succeeded", stats.fetched, counters.snapshot().succeeded);
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(database_url: impl Into<String>, pipeline: Pipeline) -> PipelineWorkerBuilder {
        PipelineWorkerBuilder {
            database_url: database_url.into(),
            pipeline,
            config: PipelineWorkerConfig::default(),
            counters: None,
            pool: None,
            pool_config: None,
        }
    }
}

impl PipelineWorkerBuilder {
    /// All settings at once; replaces those set before (set single ones after).
    pub fn config(mut self, config: PipelineWorkerConfig) -> Self {
        self.config = config;
        self
    }

    /// At most `concurrency` stage executions at once (default 4).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.config.concurrency = concurrency;
        self
    }

    /// The queue loop's settings (its `concurrency` is the builder's).
    pub fn queue(mut self, queue: QueueWorkerConfig) -> Self {
        self.config.queue = queue;
        self
    }

    /// How the next stage's workers are woken ([`PipelineWorkerConfig::wake`]).
    pub fn wake(mut self, wake: Wake) -> Self {
        self.config.wake = wake;
        self
    }

    /// How often the reconciler looks at every open item, a batch a pass
    /// (`None`: never; default 30 s).
    pub fn reconcile_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.reconcile_interval = interval;
        self
    }

    /// The most open items one reconciler pass looks at (default 1000); an
    /// interval runs passes up to the last open item.
    pub fn reconcile_batch_limit(mut self, limit: u32) -> Self {
        self.config.reconcile_batch_limit = limit;
        self
    }

    /// How long in-flight stages may finish at shutdown (default 30 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.config.queue.shutdown_grace = grace;
        self
    }

    /// The counters the worker adds to (shared between workers, say); default:
    /// its own, read through [`PipelineWorker::counters`].
    pub fn counters(mut self, counters: Arc<Counters>) -> Self {
        self.counters = Some(counters);
        self
    }

    /// The pool to work on, instead of one the builder makes. It must hold at least
    /// [`PipelineWorkerConfig::pool_size`] connections (checked by `build`).
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// How to make the pool when none is given: its connection timeout and pooler;
    /// its size is at least what the concurrency needs (default: exactly that).
    pub fn pool_config(mut self, config: PoolConfig) -> Self {
        self.pool_config = Some(config);
        self
    }

    /// The worker. Refused if the given pool is too small
    /// ([`WorkerBuildError::PoolTooSmall`], with the numbers), if the settings do
    /// not work together (as [`PipelineWorker::new`] refuses), or if the pool to
    /// make cannot connect. Nothing else connects before
    /// [`run`](PipelineWorker::run).
    pub async fn build(self) -> Result<PipelineWorker, WorkerBuildError> {
        let needed = self.config.pool_size();
        let pool = match self.pool {
            Some(pool) => {
                let pool_size = pool.config().max_size;
                if pool_size < needed {
                    let concurrency = self.config.concurrency;
                    let per_execution = u32::try_from(concurrency * 2).unwrap_or(u32::MAX);
                    return Err(WorkerBuildError::PoolTooSmall {
                        pool_size,
                        needed,
                        concurrency,
                        fixed: needed.saturating_sub(per_execution),
                    });
                }
                pool
            }
            None => {
                // Checked first: a bad setting is reported without a connection.
                PipelineWorker::check_config(&self.pipeline, &self.config)?;
                let config = match self.pool_config {
                    Some(c) => {
                        let size = c.max_size.max(needed);
                        c.with_max_size(size)
                    }
                    None => PoolConfig::default().with_max_size(needed),
                };
                connect_pool(&self.database_url, config).await?
            }
        };
        let counters = self.counters.unwrap_or_default();
        Ok(PipelineWorker::new(
            pool,
            &self.database_url,
            self.pipeline,
            self.config,
            counters,
        )?)
    }
}
