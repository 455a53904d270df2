//! A generic worker for the job queue: fetches batches, runs a handler per job with
//! bounded concurrency, completes or fails each job under its fencing token, wakes
//! on LISTEN/NOTIFY with a polling fallback, runs queue maintenance, survives
//! handler panics and database outages, and shuts down gracefully.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::queue::validate_queue_name;
use idemstage_domain::{
    FailKind, FetchedJob, JobCompleteOutcome, JobFailOutcome, JobId, JobRetryOutcome, RepoError,
    StageError,
};
use idemstage_persistence::queue::{self, JobListener, MaintenanceConfig, MaintenanceOutcome};
use idemstage_persistence::PgPool;
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What a handler reports when a job did not succeed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Retried while the job has retries left.
    #[error("{0}")]
    Retryable(String),
    /// Retrying cannot help: the job fails now (and goes to its dead-letter queue).
    #[error("{0}")]
    Permanent(String),
    /// Not now: fetch the job again after `until` (database clock; `None` = at
    /// once), without counting a failure.
    #[error("deferred: {reason}")]
    Defer {
        until: Option<chrono::DateTime<chrono::Utc>>,
        reason: String,
    },
    /// Not now: fetch the job again `after` this long (measured by the database),
    /// without counting a failure. For waiting out a database problem with backoff.
    #[error("deferred for {after:?}: {reason}")]
    DeferFor { after: Duration, reason: String },
}

impl HandlerError {
    pub fn retryable(e: impl std::fmt::Display) -> Self {
        HandlerError::Retryable(e.to_string())
    }
    pub fn permanent(e: impl std::fmt::Display) -> Self {
        HandlerError::Permanent(e.to_string())
    }
}

impl From<StageError> for HandlerError {
    fn from(e: StageError) -> Self {
        if e.is_retryable() {
            HandlerError::Retryable(e.to_string())
        } else {
            HandlerError::Permanent(e.to_string())
        }
    }
}

/// What a handler reports when a job succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// The worker completes the job (fenced on its token).
    Complete,
    /// The handler already completed the job under its token, in the transaction
    /// of its own writes (`FencedTx::complete_job`); the worker records it only.
    AlreadyCompleted,
}

/// Handles the jobs of the worker's queues. The worker deserializes the payload
/// first; a payload that does not fit `Payload` fails the job (permanently, with
/// serde's reason) without calling the handler. Use `serde_json::Value` to take
/// any payload.
pub trait JobHandler: Send + Sync + 'static {
    type Payload: DeserializeOwned + Send + 'static;
    fn handle(
        &self,
        job: FetchedJob,
        payload: Self::Payload,
    ) -> impl Future<Output = Result<Handled, HandlerError>> + Send;
}

/// A closure as a handler: `handler_fn(|job, payload: MyPayload| async move { .. })`;
/// `Ok(())` has the worker complete the job.
pub struct FnHandler<P, F> {
    f: F,
    _payload: PhantomData<fn(P)>,
}

pub fn handler_fn<P, F, Fut>(f: F) -> FnHandler<P, F>
where
    P: DeserializeOwned + Send + 'static,
    F: Fn(FetchedJob, P) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    FnHandler {
        f,
        _payload: PhantomData,
    }
}

impl<P, F, Fut> JobHandler for FnHandler<P, F>
where
    P: DeserializeOwned + Send + 'static,
    F: Fn(FetchedJob, P) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    type Payload = P;
    fn handle(
        &self,
        job: FetchedJob,
        payload: P,
    ) -> impl Future<Output = Result<Handled, HandlerError>> + Send {
        let handled = (self.f)(job, payload);
        async move { handled.await.map(|()| Handled::Complete) }
    }
}

#[derive(Clone, Debug)]
pub struct QueueWorkerConfig {
    pub queues: Vec<String>,
    /// Handlers running at once.
    pub concurrency: usize,
    /// Jobs leased per fetch (at most the free handler slots).
    pub batch_size: u32,
    /// Fallback when no notification arrives (missed, or a delayed retry came due).
    pub poll_interval: Duration,
    /// Wake on LISTEN/NOTIFY; without it the worker only polls.
    pub listen: bool,
    pub maintenance_interval: Duration,
    pub maintenance: MaintenanceConfig,
    /// On shutdown, how long in-flight handlers may finish; after that they are
    /// aborted and their jobs given back (`retry_now`, not counted as a failure).
    pub shutdown_grace: Duration,
    /// Backoff after a database error: doubles from `min` up to `max`.
    pub error_backoff_min: Duration,
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

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid worker configuration: {0}")]
    Config(String),
}

/// Counters of a running worker, readable while it runs.
#[derive(Debug, Default)]
pub struct WorkerStats {
    fetched: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    fenced: AtomicU64,
    released: AtomicU64,
    deferred: AtomicU64,
    fetch_errors: AtomicU64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerStatsSnapshot {
    pub fetched: u64,
    pub completed: u64,
    /// Failures recorded (retrying or final).
    pub failed: u64,
    /// Completions or failures refused because the lease had been taken over.
    pub fenced: u64,
    /// Jobs given back unfinished at shutdown.
    pub released: u64,
    /// Jobs given back to wait (HandlerError::Defer).
    pub deferred: u64,
    pub fetch_errors: u64,
}

impl WorkerStats {
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
        }
    }
    fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

pub struct QueueWorker<H> {
    pool: PgPool,
    database_url: String,
    config: QueueWorkerConfig,
    handler: Arc<H>,
    stats: Arc<WorkerStats>,
}

impl<H: JobHandler> QueueWorker<H> {
    /// `database_url` is for the LISTEN connection, which cannot be pooled.
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

/// How a job's run ended, to be recorded under its token.
enum Finish {
    Complete,
    /// Completed by the handler in its own transaction: nothing to write.
    AlreadyCompleted,
    Fail(String, FailKind),
    /// Shutdown: give the job back unfinished.
    Release,
    /// Give the job back to be fetched after this time.
    Defer(Option<chrono::DateTime<chrono::Utc>>),
    /// Give the job back to be fetched after this long.
    DeferFor(Duration),
}

#[allow(clippy::too_many_arguments)]
async fn run_job<H: JobHandler>(
    pool: PgPool,
    completer: Completer,
    handler: Arc<H>,
    job: FetchedJob,
    _slot: tokio::sync::OwnedSemaphorePermit,
    hard_stop: CancellationToken,
    stats: Arc<WorkerStats>,
    backoff_min: Duration,
    handler_timeout: Option<Duration>,
) {
    let finish = match job.payload_as::<H::Payload>() {
        Err(e) => Finish::Fail(e.to_string(), FailKind::Permanent),
        Ok(payload) => {
            // Its own task, so that a panic is a JoinError here and not our unwind.
            let (h, j) = (handler.clone(), job.clone());
            let mut task = tokio::spawn(async move { h.handle(j, payload).await });
            tokio::select! {
                joined = &mut task => finish_of(joined),
                // Our clock, but only for giving up on a handler: the database's
                // clock decides the lease.
                _ = async {
                    match handler_timeout {
                        Some(t) => tokio::time::sleep(t).await,
                        None => std::future::pending().await,
                    }
                } => {
                    task.abort();
                    Finish::Fail(
                        format!("handler did not finish within {:?}", handler_timeout.unwrap_or_default()),
                        FailKind::Retryable,
                    )
                }
                // The lease is renewed while the handler runs, so a job outlives a
                // slow handler but not a dead worker. If the lease was taken over,
                // the job is someone else's now: stop, and record nothing.
                lost = renew_job_lease(&pool, &job) => {
                    // A handler that completed the job itself ends its lease too:
                    // if it has just returned, its result stands.
                    if task.is_finished() {
                        let finish = finish_of(task.await);
                        record(&pool, &completer, &job, finish, &stats, backoff_min).await;
                        return;
                    }
                    task.abort();
                    tracing::warn!(job = %job.id, reason = %lost, "job lease lost; handler aborted");
                    WorkerStats::add(&stats.fenced, 1);
                    return;
                }
                _ = hard_stop.cancelled() => {
                    task.abort();
                    Finish::Release
                }
            }
        }
    };
    record(&pool, &completer, &job, finish, &stats, backoff_min).await;
}

fn finish_of(joined: Result<Result<Handled, HandlerError>, tokio::task::JoinError>) -> Finish {
    match joined {
        Ok(Ok(Handled::Complete)) => Finish::Complete,
        Ok(Ok(Handled::AlreadyCompleted)) => Finish::AlreadyCompleted,
        Ok(Err(HandlerError::Retryable(m))) => Finish::Fail(m, FailKind::Retryable),
        Ok(Err(HandlerError::Permanent(m))) => Finish::Fail(m, FailKind::Permanent),
        Ok(Err(HandlerError::Defer { until, .. })) => Finish::Defer(until),
        Ok(Err(HandlerError::DeferFor { after, .. })) => Finish::DeferFor(after),
        Err(e) if e.is_panic() => Finish::Fail(
            format!("handler panicked: {}", panic_message(e.into_panic())),
            FailKind::Retryable,
        ),
        Err(e) => Finish::Fail(format!("handler task ended: {e}"), FailKind::Retryable),
    }
}

/// Completes the jobs of many handlers with one `complete_many` each time: the
/// completions that arrive while one statement runs go together in the next
/// ("natural" batching, so a lone completion waits for nothing). One connection,
/// one statement and one commit serve a whole batch.
#[derive(Clone)]
struct Completer {
    tx: mpsc::UnboundedSender<PendingCompletion>,
}

struct PendingCompletion {
    id: JobId,
    attempt: i32,
    reply: oneshot::Sender<Result<JobCompleteOutcome, RepoError>>,
}

/// Most completions per statement.
const COMPLETION_BATCH: usize = 256;

impl Completer {
    /// The loop ends when the last `Completer` is dropped.
    fn start(pool: PgPool) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, tokio::spawn(completer_loop(pool, rx)))
    }

    async fn complete(&self, job: &FetchedJob) -> Result<JobCompleteOutcome, RepoError> {
        let (reply, outcome) = oneshot::channel();
        let stopped = || RepoError::Unavailable("the job completer has stopped".into());
        self.tx
            .send(PendingCompletion {
                id: job.id,
                attempt: job.attempt,
                reply,
            })
            .map_err(|_| stopped())?;
        outcome.await.map_err(|_| stopped())?
    }
}

async fn completer_loop(pool: PgPool, mut rx: mpsc::UnboundedReceiver<PendingCompletion>) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < COMPLETION_BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let tokens: Vec<(JobId, i32)> = batch.iter().map(|c| (c.id, c.attempt)).collect();
        let outcomes = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::complete_many(&mut conn, &tokens).await
        }
        .await;
        // Each waiting handler gets its own outcome, or the error to retry on.
        match outcomes {
            Ok(outcomes) => {
                for (pending, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = pending.reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                for pending in batch {
                    let _ = pending.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// Renews the job's lease at a third of `expire_in` until it is refused (returns
/// why). Database errors are retried at the next tick: the lease has slack.
async fn renew_job_lease(pool: &PgPool, job: &FetchedJob) -> String {
    let every = (job.expire_in / 3).max(Duration::from_millis(10));
    loop {
        tokio::time::sleep(every).await;
        let renewed = async {
            let mut conn = idemstage_persistence::get(pool).await?;
            queue::renew_lease(&mut conn, job.id, job.attempt).await
        }
        .await;
        match renewed {
            Ok(queue::RenewLeaseOutcome::Renewed { .. }) => {}
            Ok(queue::RenewLeaseOutcome::Fenced) => {
                return "the job was taken over (its lease had expired)".into()
            }
            Err(e) => tracing::warn!(job = %job.id, error = %e, "job lease renewal failed"),
        }
    }
}

/// Records the outcome, retrying transient database errors a few times. If that
/// still fails, the job stays active until its lease expires and maintenance
/// retries it. After a lost connection a retry may report `Fenced` because the
/// first attempt did commit; both end the job's lease here.
async fn record(
    pool: &PgPool,
    completer: &Completer,
    job: &FetchedJob,
    finish: Finish,
    stats: &WorkerStats,
    backoff_min: Duration,
) {
    const TRIES: u32 = 5;
    let mut delay = backoff_min;
    for tries in 1..=TRIES {
        let result = async {
            Ok::<_, RepoError>(match &finish {
                // Written by the handler: nothing to do.
                Finish::AlreadyCompleted => (&stats.completed, "completed"),
                // Without a pooled connection of its own: the completer uses one
                // for the completions of many handlers.
                Finish::Complete => match completer.complete(job).await? {
                    JobCompleteOutcome::Completed => (&stats.completed, "completed"),
                    JobCompleteOutcome::Fenced => (&stats.fenced, "fenced"),
                },
                Finish::Fail(msg, kind) => {
                    let mut conn = idemstage_persistence::get(pool).await?;
                    // Sanitised: a NUL or a huge message must not make the failure
                    // itself fail (and leave the job active until its lease ends).
                    let text = idemstage_domain::sanitize_error_text(msg);
                    match queue::fail(&mut conn, job.id, job.attempt, &text, *kind).await? {
                        JobFailOutcome::Retrying { .. } | JobFailOutcome::Failed { .. } => {
                            tracing::info!(job = %job.id, queue = %job.queue, error = %msg, "job failed");
                            (&stats.failed, "failed")
                        }
                        JobFailOutcome::Fenced => (&stats.fenced, "fenced"),
                    }
                }
                Finish::Release => {
                    let mut conn = idemstage_persistence::get(pool).await?;
                    match queue::retry_now(&mut conn, job.id, job.attempt).await? {
                        JobRetryOutcome::Requeued => (&stats.released, "released"),
                        JobRetryOutcome::Fenced => (&stats.fenced, "fenced"),
                    }
                }
                Finish::Defer(until) => {
                    let mut conn = idemstage_persistence::get(pool).await?;
                    match queue::retry_at(&mut conn, job.id, job.attempt, *until).await? {
                        JobRetryOutcome::Requeued => (&stats.deferred, "deferred"),
                        JobRetryOutcome::Fenced => (&stats.fenced, "fenced"),
                    }
                }
                Finish::DeferFor(after) => {
                    let mut conn = idemstage_persistence::get(pool).await?;
                    match queue::retry_after(&mut conn, job.id, job.attempt, *after).await? {
                        JobRetryOutcome::Requeued => (&stats.deferred, "deferred"),
                        JobRetryOutcome::Fenced => (&stats.fenced, "fenced"),
                    }
                }
            })
        }
        .await;
        match result {
            Ok((counter, what)) => {
                WorkerStats::add(counter, 1);
                tracing::debug!(job = %job.id, attempt = job.attempt, what, "job recorded");
                return;
            }
            Err(e) if e.is_retryable() && tries < TRIES => {
                tracing::warn!(job = %job.id, error = %e, "recording the job outcome failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => {
                tracing::error!(job = %job.id, error = %e, "could not record the job outcome; its lease will expire");
                return;
            }
        }
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Turns notifications for our queues into wake-ups; reconnects with backoff. After
/// every (re)connect it wakes the loop once, since notifications sent while it was
/// away are lost.
async fn listen_loop(
    url: String,
    queues: Vec<String>,
    wake: Arc<Notify>,
    backoff_min: Duration,
    backoff_max: Duration,
    stop: CancellationToken,
) {
    let mut backoff = backoff_min;
    loop {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = JobListener::connect(&url) => c,
        };
        match connected {
            Ok(mut listener) => {
                backoff = backoff_min;
                wake.notify_one();
                loop {
                    let next = tokio::select! {
                        _ = stop.cancelled() => return,
                        n = listener.next() => n,
                    };
                    match next {
                        Ok(q) if queues.contains(&q) => wake.notify_one(),
                        Ok(_) => {}
                        Err(e) => {
                            tracing::warn!(error = %e, "job listener lost; reconnecting");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "job listener cannot connect");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(backoff_max);
    }
}

/// Runs maintenance every `interval` (the first right away, to recover leases left
/// by crashed workers). Only one worker per database runs it at a time.
async fn maintenance_loop(
    pool: PgPool,
    config: MaintenanceConfig,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let ran = async {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::maintain(&mut conn, &config).await
        }
        .await;
        match ran {
            Ok(MaintenanceOutcome::Ran(r)) => {
                if r.expired_retried + r.expired_failed + r.deleted > 0 {
                    tracing::info!(?r, "queue maintenance");
                }
            }
            Ok(MaintenanceOutcome::Skipped) => {}
            Err(e) => tracing::warn!(error = %e, "queue maintenance failed"),
        }
    }
}
