//! The fetch loop: keeps up to `concurrency` handlers busy from a buffer of fetched
//! jobs, refills the buffer while the handlers run (one fetch at a time, never
//! holding more than `concurrency + prefetch` jobs), and at shutdown gives back at
//! once the jobs it never started, then waits for the running ones.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::{FetchedJob, JobId, JobRetryOutcome, RepoError};
use idemstage_persistence::queue;
use tokio::sync::Notify;
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::config::QueueWorkerConfig;
use super::handler::JobHandler;
use super::job::{run_job, JobContext};
use super::lease::{HeldLease, Leases};
use super::stats::WorkerStats;
use crate::telemetry;

type FetchFuture = Pin<Box<dyn Future<Output = Result<Vec<FetchedJob>, RepoError>> + Send>>;
/// After a short fetch: how soon a control (a rate, a hold, a cap) may let more
/// through. Asked beside the fetched jobs' start, not before it, so that it
/// adds nothing to their pickup.
type WaitFuture = Pin<Box<dyn Future<Output = Result<Option<Duration>, RepoError>> + Send>>;

/// Most tokens per release statement at shutdown.
const RELEASE_CHUNK: usize = 1000;

pub(super) struct Dispatch<H> {
    cx: Arc<JobContext<H>>,
    config: QueueWorkerConfig,
    queues: Arc<[String]>,
    leases: Leases,
    /// Fetched, leased, not started: oldest first.
    buffer: VecDeque<(FetchedJob, HeldLease)>,
    /// One task per started job, until its outcome is recorded or handed to the
    /// completer.
    running: JoinSet<()>,
}

impl<H: JobHandler> Dispatch<H> {
    pub(super) fn new(cx: Arc<JobContext<H>>, config: QueueWorkerConfig, leases: Leases) -> Self {
        Self {
            cx,
            queues: config.queues.clone().into(),
            config,
            leases,
            buffer: VecDeque::new(),
            running: JoinSet::new(),
        }
    }

    /// Works until `shutdown`: starts buffered jobs on free slots, fetches when the
    /// buffer runs low (and there is room), and after a fetch that found fewer jobs
    /// than it asked for waits for a notification (`wake`) or the poll interval.
    /// Returns with no fetch under way; its jobs are in the buffer.
    pub(super) async fn run(&mut self, shutdown: &CancellationToken, wake: &Notify) {
        let cfg = self.config.clone();
        let mut fetching: Option<(u32, FetchFuture)> = None;
        // Set after a short fetch (true: a wake-up ends the pause) or a failed one
        // (false: only the backoff does): no fetch before `pause` has passed.
        let mut paused: Option<bool> = None;
        let pause = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(pause);
        let mut backoff = cfg.error_backoff_min;
        let mut control_misses: u32 = 0;
        // The last short fetch was held back by a control: a job of this worker
        // that ends frees a slot of it (a cap), so fetch again then.
        let mut held_back = false;
        // The question after a short fetch, and whether that fetch found nothing.
        let mut asking: Option<(bool, WaitFuture)> = None;
        loop {
            while let Some(done) = self.running.try_join_next() {
                log_join_error(done);
            }
            // Checked first: once stopping, buffered jobs are given back, not started.
            if shutdown.is_cancelled() {
                break;
            }
            self.start_buffered();
            if fetching.is_none() && paused.is_none() {
                if let Some(limit) = self.fetch_limit() {
                    fetching = Some((limit, self.fetch(limit)));
                }
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                fetched = async { fetching.as_mut().expect("guarded").1.as_mut().await }, if fetching.is_some() => {
                    let (limit, _) = fetching.take().expect("guarded");
                    match fetched {
                        Ok(jobs) => {
                            backoff = cfg.error_backoff_min;
                            if jobs.len() < limit as usize {
                                // Nothing more waiting now: until a notification,
                                // the poll interval, or sooner when a control held
                                // ready jobs back (no notification comes for a
                                // refilled bucket or a slot freed elsewhere).
                                paused = Some(true);
                                pause.as_mut().reset(Instant::now() + cfg.poll_interval);
                                asking = Some((jobs.is_empty(), self.fetch_wait()));
                            }
                            self.hold(jobs);
                        }
                        Err(e) => {
                            WorkerStats::add(&self.cx.stats.fetch_errors, 1);
                            metrics::counter!(telemetry::FETCH_ERRORS).increment(1);
                            tracing::warn!(error = %e, retry_in = ?backoff, "fetch failed");
                            paused = Some(false);
                            pause.as_mut().reset(Instant::now() + backoff);
                            backoff = (backoff * 2).min(cfg.error_backoff_max);
                        }
                    }
                }
                answer = async { asking.as_mut().expect("guarded").1.as_mut().await }, if asking.is_some() => {
                    let (found_none, _) = asking.take().expect("guarded");
                    match answer {
                        // Fetches that find nothing while a control is said to let
                        // jobs through soon (they are held by something else: a
                        // paused tenant, other fetchers) wait twice as long each
                        // time, up to the poll interval.
                        Ok(Some(wait)) if paused == Some(true) => {
                            held_back = true;
                            let wait = wait.saturating_mul(1 << control_misses.min(16));
                            control_misses = if found_none { control_misses + 1 } else { 0 };
                            pause.as_mut().reset(Instant::now() + wait.min(cfg.poll_interval));
                        }
                        Ok(_) => {
                            held_back = false;
                            control_misses = 0;
                        }
                        // The poll interval stands.
                        Err(e) => tracing::debug!(error = %e, "fetch_wait failed"),
                    }
                }
                Some(done) = self.running.join_next(), if !self.running.is_empty() => {
                    log_join_error(done);
                    if held_back && paused == Some(true) {
                        paused = None;
                        control_misses = 0;
                    }
                }
                _ = wake.notified(), if paused == Some(true) => paused = None,
                _ = &mut pause, if paused.is_some() => paused = None,
            }
        }
        // A fetch under way has leased its jobs: take them, to give them back.
        if let Some((_, fetch)) = fetching {
            if let Ok(jobs) = fetch.await {
                self.hold(jobs);
            }
        }
    }

    /// How many jobs to fetch now, if any: when the buffer is down to half the
    /// prefetch (with no prefetch: empty, and a slot is free), as many as there is
    /// room for, at most `batch_size`.
    fn fetch_limit(&self) -> Option<u32> {
        let held = self.running.len() + self.buffer.len();
        let room = self.config.held_limit().saturating_sub(held);
        if room == 0 || self.buffer.len() > self.config.prefetch / 2 {
            return None;
        }
        Some(
            u32::try_from(room)
                .unwrap_or(u32::MAX)
                .min(self.config.batch_size),
        )
    }

    fn fetch(&self, limit: u32) -> FetchFuture {
        let (pool, queues) = (self.cx.pool.clone(), self.queues.clone());
        let commit = self.config.lease_commit;
        Box::pin(async move {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::fetch_with_commit(&mut conn, &queues, limit, commit).await
        })
    }

    fn fetch_wait(&self) -> WaitFuture {
        let (pool, queues) = (self.cx.pool.clone(), self.queues.clone());
        Box::pin(async move {
            let mut conn = idemstage_persistence::get(&pool).await?;
            queue::fetch_wait(&mut conn, &queues).await
        })
    }

    fn hold(&mut self, jobs: Vec<FetchedJob>) {
        WorkerStats::add(&self.cx.stats.fetched, jobs.len() as u64);
        telemetry::count_jobs(
            telemetry::JOBS_FETCHED,
            jobs.iter().map(|job| job.queue.as_str()),
        );
        let leases = self.leases.hold(&jobs);
        self.buffer.extend(jobs.into_iter().zip(leases));
    }

    fn start_buffered(&mut self) {
        while self.running.len() < self.config.concurrency {
            let Some((job, lease)) = self.buffer.pop_front() else {
                break;
            };
            // The job's span: the stage execution's span (tenant, item, stage,
            // attempt) nests in it. At WARN, like that one, so that a job's warnings
            // carry it under a filter of `warn`.
            let span = tracing::warn_span!(
                "job",
                job = %job.id,
                queue = %job.queue,
                delivery = job.attempt
            );
            // Boxed: the job's future is about 3 KB, and spawning moves it several
            // times; a box moves as a pointer (in a drain's profile, 28 % of a job
            // task's samples were those copies).
            self.running
                .spawn(Box::pin(run_job(self.cx.clone(), job, lease)).instrument(span));
        }
    }

    /// Gives back, at once, every job fetched but not started, so that another
    /// worker can take it without waiting for its lease; not counted as a failure.
    pub(super) async fn release_unstarted(&mut self) {
        let unstarted: Vec<(FetchedJob, HeldLease)> = self.buffer.drain(..).collect();
        let tokens: Vec<(JobId, i32)> = unstarted.iter().map(|(j, _)| (j.id, j.attempt)).collect();
        let queues: Vec<&str> = unstarted.iter().map(|(j, _)| j.queue.as_str()).collect();
        for (chunk, queues) in tokens
            .chunks(RELEASE_CHUNK)
            .zip(queues.chunks(RELEASE_CHUNK))
        {
            release(&self.cx, chunk, queues).await;
        }
        // Their leases are renewed until here.
        drop(unstarted);
    }

    /// Waits up to `grace` for the running handlers; then aborts the rest (their
    /// jobs are given back) and waits for them to record that.
    pub(super) async fn drain(&mut self, grace: Duration) {
        let running = &mut self.running;
        let drained = async {
            while let Some(done) = running.join_next().await {
                log_join_error(done);
            }
        };
        if tokio::time::timeout(grace, drained).await.is_err() {
            tracing::warn!(
                ?grace,
                still_running = self.running.len(),
                "shutdown grace period over; giving the remaining jobs back"
            );
            self.cx.hard_stop.cancel();
            while let Some(done) = self.running.join_next().await {
                log_join_error(done);
            }
        }
    }
}

/// One release statement for `tokens` (of `queues`, one each), retrying transient
/// errors a few times; if that still fails, the jobs wait for their leases to
/// expire.
async fn release<H>(cx: &JobContext<H>, tokens: &[(JobId, i32)], queues: &[&str]) {
    const TRIES: u32 = 5;
    let mut delay = cx.backoff_min;
    for tries in 1..=TRIES {
        let released = async {
            let mut conn = idemstage_persistence::get(&cx.pool).await?;
            queue::retry_now_many(&mut conn, tokens).await
        }
        .await;
        match released {
            Ok(outcomes) => {
                let requeued = outcomes
                    .iter()
                    .filter(|o| **o == JobRetryOutcome::Requeued)
                    .count() as u64;
                WorkerStats::add(&cx.stats.released, requeued);
                WorkerStats::add(&cx.stats.fenced, tokens.len() as u64 - requeued);
                for (outcome, queue) in outcomes.iter().zip(queues) {
                    let name = match outcome {
                        JobRetryOutcome::Requeued => telemetry::JOBS_RELEASED,
                        JobRetryOutcome::Fenced => telemetry::JOBS_FENCED,
                    };
                    telemetry::count_job(name, queue, 1);
                }
                tracing::debug!(jobs = tokens.len(), requeued, "unstarted jobs given back");
                return;
            }
            Err(e) if e.is_retryable() && tries < TRIES => {
                tracing::warn!(error = %e, jobs = tokens.len(), "giving unstarted jobs back failed; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => {
                tracing::error!(error = %e, jobs = tokens.len(), "could not give unstarted jobs back; their leases will expire");
                return;
            }
        }
    }
}

fn log_join_error(done: Result<(), JoinError>) {
    if let Err(e) = done {
        tracing::error!(error = %e, "job task failed");
    }
}
