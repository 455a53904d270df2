//! `idemstage worker`: works the pipeline's stage queues until SIGINT or
//! SIGTERM, then stops fetching, lets in-flight stages finish within the grace
//! period, gives the rest back, and exits 0.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use idemstage::db::RepoError;
use idemstage::pipeline::Pipeline;
use idemstage::{db::PoolConfig, db::Pooler};
use idemstage::{worker::Counters, worker::PipelineWorker, worker::PipelineWorkerConfig};
use tokio_util::sync::CancellationToken;

use super::{BadInput, WakeArg};

/// How often a worker serving metrics samples its queues' depth from the database.
const QUEUE_GAUGES_INTERVAL: Duration = Duration::from_secs(1);

/// The poll interval of a worker without LISTEN (through a transaction pooler and
/// no --listen-url): no notification wakes it, so it looks more often.
const UNLISTENED_POLL: Duration = Duration::from_millis(250);

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Stage executions at once
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Jobs fetched ahead of free slots (leased and renewed while they wait; given
    /// back at once on shutdown). 0: fetch only for free slots, which leaves
    /// jobs to other workers, best for long stages
    #[arg(long, default_value_t = 0)]
    pub prefetch: usize,
    /// When the next stage's job wakes its workers: after-commit keeps the NOTIFY
    /// out of the stage's commit (PostgreSQL serializes notifying commits)
    #[arg(long, value_enum, default_value_t = WakeArg::AfterCommit)]
    pub wake: WakeArg,
    /// Queues (stage names) to work; default: every stage of the pipeline
    #[arg(long, value_delimiter = ',')]
    pub queues: Vec<String>,
    /// Seconds in-flight stages may take to finish after SIGINT/SIGTERM
    #[arg(long, default_value_t = 20)]
    pub grace_s: u64,
    /// Lease of the jobs this worker sends, in milliseconds; renewed while a job
    /// runs, so it bounds how long a dead worker's job waits to be retried
    #[arg(long, default_value_t = 60_000)]
    pub job_lease_ms: u64,
    /// Seconds between the reconciler's looks at every open item, which re-send
    /// the job of every stage that is expected, not final and has no live job
    /// (0: off)
    #[arg(long, default_value_t = 30)]
    pub reconcile_interval_s: u64,
    /// Serve Prometheus metrics on this address (GET /metrics), e.g.
    /// 127.0.0.1:9464; port 0 picks a free one. The bound address is printed on
    /// stderr. The metrics (README, "Metrics"): jobs fetched, completed, retried
    /// and failed per queue, stage outcomes and durations per stage, lease renewals,
    /// queue depth and oldest ready job's age (sampled from the database every
    /// second)
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Start even when connected as a role that row-level security does not
    /// restrict, or that can make itself the tables' owner (a superuser,
    /// BYPASSRLS, CREATEROLE, the owner of the tables, the database or the schema,
    /// CREATE on the schema). Without it such a worker refuses to start (exit 2):
    /// connect as a login role in idemstage_worker instead (README, "Deploying")
    #[arg(long, env = "IDEMSTAGE_ALLOW_OWNER")]
    pub allow_owner: bool,
    /// A direct URL to the server (not through a pooler) for LISTEN, which wakes the
    /// worker when a job is sent. Default: the database URL, unless it leads through
    /// a transaction pooler (--pooler transaction): then the worker polls every
    /// --poll-ms instead
    #[arg(long, env = "IDEMSTAGE_LISTEN_URL", hide_env_values = true)]
    pub listen_url: Option<String>,
    /// How often an idle worker looks for jobs without a notification, in
    /// milliseconds [default: 2000, or 250 when it polls for lack of LISTEN]
    #[arg(long)]
    pub poll_ms: Option<u64>,
}

impl Args {
    /// The pipeline to work: the team's as it is (its stages carry their own
    /// policies), with the job lease.
    pub fn pipeline(&self, team: Pipeline) -> anyhow::Result<Pipeline> {
        if self.job_lease_ms < 100 {
            return Err(BadInput("--job-lease-ms must be >= 100".into()).into());
        }
        let mut send = Pipeline::default_send_options();
        send.expire_in = Duration::from_millis(self.job_lease_ms);
        team.with_send_options(send)
            .map_err(|e| BadInput(e.to_string()).into())
    }

    /// The URL its LISTEN connection uses, if it listens: `--listen-url`, else the
    /// database URL when it is direct.
    pub fn listen_url(&self, db: &super::Db) -> Option<String> {
        match (&self.listen_url, db.pooler) {
            (Some(url), _) => Some(url.clone()),
            (None, Pooler::None) => Some(db.url.clone()),
            (None, Pooler::Transaction) => None,
        }
    }

    pub fn worker_config(&self, db: &super::Db) -> anyhow::Result<PipelineWorkerConfig> {
        let mut config = PipelineWorkerConfig::default()
            .with_concurrency(self.concurrency)
            .with_wake(self.wake.into());
        config.queue.listen = self.listen_url(db).is_some();
        match self.poll_ms {
            Some(0) => return Err(BadInput("--poll-ms must be positive".into()).into()),
            Some(ms) => config.queue.poll_interval = Duration::from_millis(ms),
            None if !config.queue.listen => config.queue.poll_interval = UNLISTENED_POLL,
            None => {}
        }
        config.queue.queues = self.queues.clone();
        config.queue.prefetch = self.prefetch;
        config.queue.shutdown_grace = Duration::from_secs(self.grace_s);
        if self.metrics_listen.is_some() {
            config.queue.queue_gauges_interval = Some(QUEUE_GAUGES_INTERVAL);
        }
        config = config.with_reconcile_interval(
            (self.reconcile_interval_s > 0).then(|| Duration::from_secs(self.reconcile_interval_s)),
        );
        // Expired job leases are only recovered by maintenance: run it at least as
        // often as a lease lasts (PipelineWorker refuses a longer interval).
        config.queue.maintenance_interval = config
            .queue
            .maintenance_interval
            .min(Duration::from_millis(self.job_lease_ms));
        Ok(config)
    }
}

pub async fn run(db: &super::Db, args: Args, team: Pipeline) -> anyhow::Result<ExitCode> {
    if args.concurrency == 0 {
        return Err(BadInput("--concurrency must be positive".into()).into());
    }
    let pipeline = args.pipeline(team)?;
    // Bad input is refused before the first connection (exit 2, not 3).
    for q in &args.queues {
        pipeline.stage(q).map_err(|e| BadInput(e.to_string()))?;
    }
    // Before the first connection too: a bad or busy address is bad input.
    if let Some(listen) = args.metrics_listen {
        let addr = super::prometheus::serve(listen).await?;
        eprintln!("idemstage worker: metrics on http://{addr}/metrics");
    }
    let config = args.worker_config(db)?;
    let pool_config = PoolConfig::default().with_max_size(config.pool_size());
    let listen_url = args.listen_url(db);
    let (pool, role) = starting(async || {
        let pool = db.pool(pool_config.clone()).await?;
        // A --listen-url that cannot LISTEN is refused now, not warned about forever.
        if let Some(url) = listen_url.as_deref().filter(|u| **u != db.url) {
            idemstage::queue::JobListener::connect(url)
                .await
                .map_err(|e| RepoError::Unavailable(format!("--listen-url: {e}").into()))?;
        }
        // Row-level security holds only for a role it restricts (README, "Deploying").
        let role = {
            let mut conn = idemstage::db::get(&pool).await?;
            idemstage::roles::check_worker_role(&mut conn).await?
        };
        Ok((pool, role))
    })
    .await?;
    let worker = PipelineWorker::new(
        pool.clone(),
        listen_url.as_deref().unwrap_or(&db.url),
        pipeline,
        config,
        Arc::new(Counters::default()),
    )
    .map_err(|e| BadInput(e.to_string()))?;
    if !role.is_restricted() {
        if !args.allow_owner {
            return Err(BadInput(format!(
                "idemstage worker refuses to start: {role}. Connect as a login role in \
                 {} that owns nothing and has no CREATEROLE (CREATE ROLE w LOGIN \
                 PASSWORD '..' IN ROLE {}; README, \"Deploying\"), or pass --allow-owner",
                idemstage::roles::WORKER_ROLE,
                idemstage::roles::WORKER_ROLE,
            ))
            .into());
        }
        eprintln!("idemstage worker: --allow-owner: {role}");
    }
    tracing::info!(worker = %worker.worker_id().as_str(), "worker started");
    eprintln!(
        "idemstage worker {} started; SIGINT/SIGTERM stops it",
        worker.worker_id().as_str()
    );
    let shutdown = CancellationToken::new();
    let signals = {
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("install SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("idemstage worker: stopping (grace {}s)", args.grace_s);
            shutdown.cancel();
        })
    };
    let stats = worker.run(shutdown).await;
    signals.abort();
    eprintln!(
        "idemstage worker stopped: {} jobs completed, {} failed, {} released, {} deferred",
        stats.completed, stats.failed, stats.released, stats.deferred
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs the worker's first statements again when the database was unavailable
/// (a connection terminated under them, a server restarting), a few times within
/// about a second; then gives up with the last error (exit 3). Once running, the
/// worker rides out any outage on its own.
async fn starting<T>(mut step: impl AsyncFnMut() -> Result<T, RepoError>) -> Result<T, RepoError> {
    let mut backoff = Duration::from_millis(100);
    for _ in 0..STARTUP_RETRIES {
        match step().await {
            Err(RepoError::Unavailable(e)) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "worker start: database unavailable");
                tokio::time::sleep(backoff).await;
                backoff *= 2;
            }
            done => return done,
        }
    }
    step().await
}

/// How often [`starting`] tries again: 100 + 200 + 400 + 800 ms of waiting.
const STARTUP_RETRIES: usize = 4;
