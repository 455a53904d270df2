//! One job's task: deserialize, run the handler (keeping the job leased, within
//! its timeout), and record how it ended under the job's token.

use std::sync::Arc;
use std::time::Duration;

use idemstage_domain::{
    FailKind, FetchedJob, JobCompleteOutcome, JobFailOutcome, JobRetryOutcome, RepoError,
};
use idemstage_persistence::queue;
use idemstage_persistence::PgPool;
use tokio_util::sync::CancellationToken;

use super::completer::Completer;
use super::handler::{Handled, HandlerError, JobHandler};
use super::stats::WorkerStats;

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
pub(super) async fn run_job<H: JobHandler>(
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
                lost = keep_job_leased(&pool, &job) => {
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

/// Renews the job's lease at a third of `expire_in` until it is refused (returns
/// why). Database errors are retried at the next tick: the lease has slack.
async fn keep_job_leased(pool: &PgPool, job: &FetchedJob) -> String {
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
